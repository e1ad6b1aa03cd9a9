//! Stop strings: generation ends when its text contains one, and that text is never shown.
//! Text is held back while its end could still become a stop string, so a stop string
//! split over several tokens is caught before any of it is printed.

/// Scans streamed text for the first occurrence of any stop string.
#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Text received but not yet released: a suffix that may begin a stop string.
    held: String,
}

impl StopStrings {
    /// `stops` must be non-empty strings (the CLI refuses an empty one).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    /// Takes the next piece of text; returns the text that is safe to show now and whether a
    /// stop string was found (what follows it, and the string itself, are dropped).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        if let Some(at) = first_match(&self.held, &self.stops) {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        let keep = self.longest_partial();
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// What is still held back at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Bytes at the end of `held` that are a proper prefix of some stop string.
    fn longest_partial(&self) -> usize {
        let held = &self.held;
        (1..=held.len())
            .rev()
            .filter(|&n| held.is_char_boundary(held.len() - n))
            .find(|&n| {
                let tail = &held[held.len() - n..];
                self.stops
                    .iter()
                    .any(|s| s.len() > n && s.starts_with(tail))
            })
            .unwrap_or(0)
    }
}

/// The byte offset in `text` of the earliest stop string, if any.
pub fn first_match(text: &str, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
}

#[cfg(test)]
mod tests {
    use super::StopStrings;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = StopStrings::new(&stops);
        let mut shown = String::new();
        for p in pieces {
            let (out, stopped) = s.push(p);
            shown.push_str(&out);
            if stopped {
                return (shown, true);
            }
        }
        shown.push_str(&s.finish());
        (shown, false)
    }

    #[test]
    fn a_stop_split_over_pieces_is_never_shown() {
        assert_eq!(
            run(&["\nUser:"], &["Hello", " there", "\nUs", "er", ": more"]),
            ("Hello there".into(), true)
        );
    }

    #[test]
    fn a_partial_match_that_fails_is_released() {
        assert_eq!(
            run(&["STOP"], &["ST", "OK", " fine"]),
            ("STOK fine".into(), false)
        );
        // Held text comes out at the end even when it still looks like a prefix.
        assert_eq!(run(&["STOP"], &["a S", "T"]), ("a ST".into(), false));
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_unicode_is_safe() {
        assert_eq!(
            run(&["world", "wö"], &["héllo ", "wörld"]),
            ("héllo ".into(), true)
        );
        assert_eq!(run(&["é!"], &["caf", "é", "?"]), ("café?".into(), false));
    }
}
