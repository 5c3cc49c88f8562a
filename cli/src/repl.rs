//! The interactive shell: line editing, history, multi-line statements.

use rustyline::error::ReadlineError;
use rustyline::DefaultEditor;

use crate::exec::Shell;

const BANNER: &str = "zarrfusion: Zarr stores as SQL tables. \\? for help, \\q to quit.";

/// Reads statements until `\q` or end of input.
pub async fn run(shell: &mut Shell) -> rustyline::Result<()> {
    let mut editor = DefaultEditor::new()?;
    let history = dirs::home_dir().map(|h| h.join(".zarrfusion_history"));
    if let Some(path) = &history {
        let _ = editor.load_history(path);
    }
    println!("{BANNER}");
    let mut buffer = String::new();
    loop {
        let prompt = if buffer.is_empty() {
            "zarrfusion> "
        } else {
            "        ..> "
        };
        match editor.readline(prompt) {
            Ok(line) => {
                let trimmed = line.trim();
                if buffer.is_empty() && trimmed.starts_with('\\') {
                    let _ = editor.add_history_entry(trimmed);
                    if trimmed == "\\q" {
                        break;
                    }
                    if let Err(e) = shell.run_text(trimmed).await {
                        eprintln!("Error: {e}");
                    }
                    continue;
                }
                buffer.push_str(&line);
                buffer.push('\n');
                if trimmed.ends_with(';') {
                    let text = std::mem::take(&mut buffer);
                    let _ = editor.add_history_entry(text.trim());
                    if let Err(e) = shell.run_text(&text).await {
                        eprintln!("Error: {e}");
                    }
                }
            }
            Err(ReadlineError::Interrupted) => buffer.clear(),
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e),
        }
    }
    if let Some(path) = &history {
        let _ = editor.save_history(path);
    }
    Ok(())
}
