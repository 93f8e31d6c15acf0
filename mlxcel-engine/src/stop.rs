//! Stop strings over streamed text: text that could still turn into a stop
//! string is held back until it can't.

pub(crate) struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released.
    pending: String,
}

pub(crate) enum StopOutcome {
    /// Release this text and continue.
    Continue(String),
    /// A stop string matched: release this text (before the stop) and finish.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        StopMatcher { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), pending: String::new() }
    }

    pub fn push(&mut self, piece: &str) -> StopOutcome {
        self.pending.push_str(piece);
        let earliest = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min();
        if let Some(at) = earliest {
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return StopOutcome::Stopped(text);
        }
        let hold = self.longest_partial_stop();
        let release = self.pending.len() - hold;
        let text = self.pending[..release].to_string();
        self.pending.drain(..release);
        StopOutcome::Continue(text)
    }

    /// What was held back, at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that starts some stop string.
    fn longest_partial_stop(&self) -> usize {
        let p = &self.pending;
        (1..=p.len())
            .rev()
            .filter(|&n| p.is_char_boundary(p.len() - n))
            .find(|&n| self.stops.iter().any(|s| s.starts_with(&p[p.len() - n..])))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Continue(t) => out += &t,
                StopOutcome::Stopped(t) => return (out + &t, true),
            }
        }
        (out + &m.finish(), false)
    }

    #[test]
    fn stops_across_pieces_and_holds_back_prefixes() {
        assert_eq!(run(&["\n\n"], &["Paris.", "\n", "\nNext"]), ("Paris.".into(), true));
        assert_eq!(run(&["STOP"], &["a S", "T", "x"]), ("a STx".into(), false));
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn releases_text_that_cannot_start_a_stop() {
        let stops = vec!["END".to_string()];
        let mut m = StopMatcher::new(&stops);
        match m.push("hello E") {
            StopOutcome::Continue(t) => assert_eq!(t, "hello "),
            StopOutcome::Stopped(_) => panic!("no stop yet"),
        }
    }
}
