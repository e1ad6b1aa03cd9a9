//! `strftime_now` as transformers defines it in Python (`datetime.now().strftime`), here in
//! UTC with a fixed set of directives.

use super::py::invalid;
use minijinja::Error;
use std::fmt::Write;

/// `strftime_now(format)`: the current UTC time with `%d %m %Y %y %b %B %a %A %H %M %S %j
/// %%`; any other directive is an error rather than a silently different date.
pub fn strftime_now(format: &str) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| invalid(format!("strftime_now: clock before 1970: {e}")))?
        .as_secs();
    strftime(format, secs as i64)
}

/// `format` applied to the UTC time `secs` seconds after 1970-01-01.
pub fn strftime(format: &str, secs: i64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('d') => write!(out, "{d:02}"),
            Some('m') => write!(out, "{m:02}"),
            Some('Y') => write!(out, "{y}"),
            Some('y') => write!(out, "{:02}", y.rem_euclid(100)),
            Some('b') => write!(out, "{}", &MONTHS[m as usize - 1][..3]),
            Some('B') => write!(out, "{}", MONTHS[m as usize - 1]),
            Some('a') => write!(out, "{}", &DAYS[weekday][..3]),
            Some('A') => write!(out, "{}", DAYS[weekday]),
            Some('H') => write!(out, "{:02}", sod / 3600),
            Some('M') => write!(out, "{:02}", sod / 60 % 60),
            Some('S') => write!(out, "{:02}", sod % 60),
            Some('j') => write!(out, "{yday:03}"),
            Some('%') => write!(out, "%"),
            other => {
                let directive = other.map(|c| format!("%{c}")).unwrap_or("a lone %".into());
                return Err(invalid(format!(
                    "strftime_now: unsupported directive {directive}"
                )));
            }
        };
    }
    Ok(out)
}

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01 (Howard Hinnant's
/// proleptic Gregorian algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// The inverse of [`civil_from_days`].
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}
