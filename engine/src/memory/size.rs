//! Parsing sizes such as `2GB`, `2G`, `512MB`, `100KB` or `1048576`.

/// Parses a size in bytes. Units are binary (`1KB` = 1024 bytes), any case,
/// with an optional `B`/`iB` suffix; a bare number is bytes.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("invalid size '{text}': expected a number with a unit like 2GB"))?;
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("invalid size '{text}': unknown unit '{other}'")),
    };
    let bytes = value * multiplier as f64;
    if !bytes.is_finite() || bytes < 1.0 || bytes > usize::MAX as f64 {
        return Err(format!("invalid size '{text}': out of range"));
    }
    Ok(bytes as usize)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("2GB").unwrap(), 2 << 30);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert_eq!(parse_size("512MB").unwrap(), 512 << 20);
        assert_eq!(parse_size("100kb").unwrap(), 100 << 10);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("5 parsecs").is_err());
        assert!(parse_size("0MB").is_err());
    }
}
