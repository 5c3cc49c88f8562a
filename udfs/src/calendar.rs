//! CF calendars: how each counts its days, as cftime counts them.
//!
//! `standard` (or `gregorian`) is Julian before 1582-10-15 and Gregorian
//! from then on; `proleptic_gregorian` is Gregorian throughout; `noleap`
//! (`365_day`) and `all_leap` (`366_day`) have years of 365 and 366 days;
//! `360_day` has twelve months of 30 days; `julian` has a leap day every
//! fourth year. Years are astronomical (0 is 1 BC).
//!
//! The two Gregorian calendars and `julian` count days on one scale, days
//! since 1970-01-01 in the Gregorian calendar, so that a `standard` date
//! before 1582 is the day it was; the idealized calendars count from their
//! own year 0.

use std::fmt;

/// A date of a calendar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Date {
    /// The astronomical year (0 is 1 BC).
    pub year: i64,
    /// 1 to 12.
    pub month: u32,
    /// From 1.
    pub day: u32,
}

impl fmt::Display for Date {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04}-{:02}-{:02}", self.year, self.month, self.day)
    }
}

/// A calendar of the CF conventions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Calendar {
    /// `standard`, `gregorian`: Julian until 1582-10-04, Gregorian from
    /// 1582-10-15.
    Standard,
    /// `proleptic_gregorian`.
    ProlepticGregorian,
    /// `noleap`, `365_day`.
    NoLeap,
    /// `all_leap`, `366_day`.
    AllLeap,
    /// `360_day`.
    Day360,
    /// `julian`.
    Julian,
}

/// Days of the months of a year without a leap day.
const MONTH_DAYS: [u32; 12] = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];

/// The first Gregorian day of the `standard` calendar.
const GREGORIAN_START: Date = Date {
    year: 1582,
    month: 10,
    day: 15,
};

/// The last Julian day of the `standard` calendar.
const JULIAN_END: Date = Date {
    year: 1582,
    month: 10,
    day: 4,
};

impl Calendar {
    /// The calendar named `name` (any case), if it is one of CF's.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name.trim().to_ascii_lowercase().as_str() {
            "standard" | "gregorian" => Self::Standard,
            "proleptic_gregorian" => Self::ProlepticGregorian,
            "noleap" | "365_day" => Self::NoLeap,
            "all_leap" | "366_day" => Self::AllLeap,
            "360_day" => Self::Day360,
            "julian" => Self::Julian,
            _ => return None,
        })
    }

    /// Its CF name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Standard => "standard",
            Self::ProlepticGregorian => "proleptic_gregorian",
            Self::NoLeap => "noleap",
            Self::AllLeap => "all_leap",
            Self::Day360 => "360_day",
            Self::Julian => "julian",
        }
    }

    /// Whether its instants are the Gregorian calendar's (timestamps count
    /// the same days); otherwise its dates become timestamps by their fields.
    pub fn is_gregorian(self) -> bool {
        matches!(self, Self::Standard | Self::ProlepticGregorian)
    }

    /// Whether some of its dates are no date of the proleptic Gregorian
    /// calendar, and so have no timestamp (the 30th of February of
    /// `360_day`, the 29th of February 2001 of `all_leap`, of 1900 of
    /// `julian`).
    pub fn lacks_gregorian_days(self) -> bool {
        matches!(self, Self::AllLeap | Self::Day360 | Self::Julian)
    }

    /// The number of days of a month (1 to 12; others as the nearest) of a
    /// year.
    pub fn days_in_month(self, year: i64, month: u32) -> u32 {
        let julian_leap = year.rem_euclid(4) == 0;
        let gregorian_leap =
            julian_leap && (year.rem_euclid(100) != 0 || year.rem_euclid(400) == 0);
        let leap = match self {
            Self::Day360 => return 30,
            _ if month != 2 => return MONTH_DAYS[month.clamp(1, 12) as usize - 1],
            Self::NoLeap => false,
            Self::AllLeap => true,
            Self::ProlepticGregorian => gregorian_leap,
            Self::Julian => julian_leap,
            Self::Standard if year > GREGORIAN_START.year => gregorian_leap,
            Self::Standard => julian_leap,
        };
        28 + u32::from(leap)
    }

    /// The number of `date`'s day (see the module's documentation for
    /// where each calendar counts from), or `None` when the calendar has no
    /// such date. Years must be within ±10^9.
    pub fn day_number(self, date: Date) -> Option<i64> {
        let Date { year, month, day } = date;
        if !(1..=12).contains(&month) || day < 1 || day > self.days_in_month(year, month) {
            return None;
        }
        let (month, day) = (i64::from(month), i64::from(day));
        // The days of the months before `month` in a year of the calendar.
        let before = |calendar: Self| -> i64 {
            (1..date.month)
                .map(|m| i64::from(calendar.days_in_month(1, m)))
                .sum()
        };
        Some(match self {
            Self::NoLeap => year * 365 + before(self) + day - 1,
            Self::AllLeap => year * 366 + before(self) + day - 1,
            Self::Day360 => year * 360 + (month - 1) * 30 + day - 1,
            Self::ProlepticGregorian => gregorian_days(year, month, day),
            Self::Julian => julian_days(year, month, day),
            Self::Standard if date >= GREGORIAN_START => gregorian_days(year, month, day),
            Self::Standard if date <= JULIAN_END => julian_days(year, month, day),
            // 1582-10-05 to 1582-10-14 never were.
            Self::Standard => return None,
        })
    }

    /// The day of its year of `date` (1 for the 1st of January), as
    /// cftime's `dayofyr`; `None` when the calendar has no such date.
    pub fn day_of_year(self, date: Date) -> Option<i64> {
        let first = Date {
            month: 1,
            day: 1,
            ..date
        };
        Some(self.day_number(date)? - self.day_number(first)? + 1)
    }

    /// The day of the week of `date`, Monday 0 to Sunday 6, counted on
    /// through the calendar's own days, as cftime's `dayofwk`; `None` when
    /// the calendar has no such date.
    pub fn weekday(self, date: Date) -> Option<i64> {
        let number = self.day_number(date)?;
        Some(match self {
            // Day 0 of the idealized calendars is a Monday for cftime.
            Self::NoLeap | Self::AllLeap | Self::Day360 => number.rem_euclid(7),
            // 1970-01-01 (day 0 of the shared scale) was a Thursday.
            Self::ProlepticGregorian | Self::Standard | Self::Julian => (number + 3).rem_euclid(7),
        })
    }

    /// The date of day number `number` (the inverse of
    /// [`Self::day_number`]). Numbers must be within ±10^11.
    pub fn date(self, number: i64) -> Date {
        let by_months = |year_days: i64| {
            let year = number.div_euclid(year_days);
            let mut day = number.rem_euclid(year_days) as u32;
            let mut month = 1;
            while month < 12 && day >= self.days_in_month(year, month) {
                day -= self.days_in_month(year, month);
                month += 1;
            }
            Date {
                year,
                month,
                day: day + 1,
            }
        };
        match self {
            Self::NoLeap => by_months(365),
            Self::AllLeap => by_months(366),
            Self::Day360 => by_months(360),
            Self::ProlepticGregorian => gregorian_date(number),
            Self::Julian => julian_date(number),
            Self::Standard if number >= gregorian_days(1582, 10, 15) => gregorian_date(number),
            Self::Standard => julian_date(number),
        }
    }
}

/// Days from the Gregorian 1970-01-01 to a Gregorian date: the era
/// arithmetic of Howard Hinnant's `days_from_civil`, in years that start
/// on the 1st of March so that the leap day ends them.
fn gregorian_days(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    // 719,468 days from 0000-03-01 to 1970-01-01.
    era * 146_097 + day_of_era - 719_468
}

/// The Gregorian date of a number of [`gregorian_days`].
fn gregorian_date(number: i64) -> Date {
    let days = number + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    march_date(era * 400 + year_of_era, day_of_year)
}

/// Days from the Gregorian 1970-01-01 to a Julian date: as
/// [`gregorian_days`], with eras of four years.
fn julian_days(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(4);
    let year_of_era = year - era * 4;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    // The Julian 0000-03-01 is the Gregorian 0000-02-28: 719,470 days
    // before 1970-01-01.
    era * 1461 + year_of_era * 365 + day_of_year - 719_470
}

/// The Julian date of a number of [`julian_days`].
fn julian_date(number: i64) -> Date {
    let days = number + 719_470;
    let era = days.div_euclid(1461);
    let day_of_era = days - era * 1461;
    let year_of_era = (day_of_era / 365).min(3);
    march_date(era * 4 + year_of_era, day_of_era - year_of_era * 365)
}

/// The date of a day of a year that starts on the 1st of March.
fn march_date(march_year: i64, day_of_year: i64) -> Date {
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    Date {
        year: march_year + i64::from(month <= 2),
        month: month as u32,
        day: day as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Calendar; 6] = [
        Calendar::Standard,
        Calendar::ProlepticGregorian,
        Calendar::NoLeap,
        Calendar::AllLeap,
        Calendar::Day360,
        Calendar::Julian,
    ];

    /// Every date of every calendar over some centuries, counted one day
    /// at a time from the first: numbers follow each other, and each number
    /// is its date's.
    #[test]
    fn day_numbers_count_every_date_once_in_order() {
        for calendar in ALL {
            let first = Date {
                year: -401,
                month: 1,
                day: 1,
            };
            let mut expected = calendar.day_number(first).unwrap();
            for year in -401..=2401 {
                for month in 1..=12 {
                    for day in 1..=calendar.days_in_month(year, month) {
                        let date = Date { year, month, day };
                        let Some(number) = calendar.day_number(date) else {
                            assert_eq!(calendar, Calendar::Standard, "{date}");
                            assert!(date > JULIAN_END && date < GREGORIAN_START, "{date}");
                            continue;
                        };
                        assert_eq!(number, expected, "{calendar:?} {date}");
                        assert_eq!(calendar.date(number), date, "{calendar:?} {number}");
                        expected += 1;
                    }
                }
            }
        }
    }

    #[test]
    fn the_standard_calendar_turns_gregorian_on_1582_10_15() {
        let standard = Calendar::Standard;
        let last_julian = standard.day_number(JULIAN_END).unwrap();
        assert_eq!(
            standard.date(last_julian + 1),
            GREGORIAN_START,
            "the day after 1582-10-04"
        );
        // The Julian and Gregorian scales are one: 1582-10-15 is the same
        // day in both counts, and 1970-01-01 is day 0.
        assert_eq!(
            Calendar::Julian.day_number(Date {
                year: 1582,
                month: 10,
                day: 5
            }),
            Calendar::ProlepticGregorian.day_number(GREGORIAN_START)
        );
        let epoch = Date {
            year: 1970,
            month: 1,
            day: 1,
        };
        assert_eq!(Calendar::ProlepticGregorian.day_number(epoch), Some(0));
        assert_eq!(Calendar::Standard.day_number(epoch), Some(0));
    }

    #[test]
    fn dates_a_calendar_lacks_have_no_number() {
        let feb = |year, day| Date {
            year,
            month: 2,
            day,
        };
        assert_eq!(Calendar::NoLeap.day_number(feb(2000, 29)), None);
        assert!(Calendar::AllLeap.day_number(feb(2001, 29)).is_some());
        assert!(Calendar::Day360.day_number(feb(2001, 30)).is_some());
        assert_eq!(Calendar::ProlepticGregorian.day_number(feb(1900, 29)), None);
        assert!(Calendar::Julian.day_number(feb(1900, 29)).is_some());
        let missing = Date {
            year: 1582,
            month: 10,
            day: 10,
        };
        assert_eq!(Calendar::Standard.day_number(missing), None);
        for calendar in ALL {
            for (month, day) in [(0, 1), (13, 1), (1, 0), (1, 32), (4, 31)] {
                let date = Date {
                    year: 2000,
                    month,
                    day,
                };
                assert_eq!(calendar.day_number(date), None, "{calendar:?} {date}");
            }
        }
    }

    #[test]
    fn names_parse_as_cf_spells_them() {
        for calendar in ALL {
            assert_eq!(Calendar::parse(calendar.name()), Some(calendar));
        }
        assert_eq!(Calendar::parse(" Gregorian "), Some(Calendar::Standard));
        assert_eq!(Calendar::parse("365_day"), Some(Calendar::NoLeap));
        assert_eq!(Calendar::parse("366_DAY"), Some(Calendar::AllLeap));
        assert_eq!(Calendar::parse("none"), None);
    }

    /// Days of the week and of the year follow each other day after day
    /// through each calendar's own days (the 28th of February to the 1st of
    /// March in `noleap`, the 30th of February in `360_day`).
    #[test]
    fn weekdays_and_days_of_the_year_count_the_calendars_days() {
        for calendar in ALL {
            let start = calendar
                .day_number(Date {
                    year: 1999,
                    month: 1,
                    day: 1,
                })
                .unwrap();
            let mut day_of_year = 0;
            let mut weekday = calendar.weekday(calendar.date(start)).unwrap();
            for number in start..start + 3 * 366 {
                let date = calendar.date(number);
                day_of_year = if date.month == 1 && date.day == 1 {
                    1
                } else {
                    day_of_year + 1
                };
                assert_eq!(calendar.day_of_year(date), Some(day_of_year), "{date}");
                assert_eq!(calendar.weekday(date), Some(weekday), "{date}");
                weekday = (weekday + 1) % 7;
            }
        }
        // 2000-01-01 was a Saturday.
        let date = Date {
            year: 2000,
            month: 1,
            day: 1,
        };
        assert_eq!(Calendar::ProlepticGregorian.weekday(date), Some(5));
        let leap_day = Date {
            year: 2001,
            month: 2,
            day: 29,
        };
        assert_eq!(Calendar::NoLeap.weekday(leap_day), None);
        assert_eq!(Calendar::NoLeap.day_of_year(leap_day), None);
    }
}
