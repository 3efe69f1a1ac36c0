//! How the workspace prints an error: the error's own message, then each
//! of its causes (`source()`), outermost first.
//!
//! Errors here are `thiserror` enums whose messages do not repeat their
//! source, so a log line or an API answer needs the whole chain: [`chain`]
//! joins it on one line, [`messages`] gives it as a list (the HTTP API's
//! error bodies are that list as a JSON array).
#![warn(missing_docs)]

use std::error::Error;

/// The error's message and each cause's, outermost first.
pub fn messages(e: &dyn Error) -> Vec<String> {
    let mut out = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push(c.to_string());
        cur = c.source();
    }
    out
}

/// [`messages`] on one line, joined with ": ".
pub fn chain(e: &dyn Error) -> String {
    messages(e).join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct E(&'static str, Option<Box<E>>);

    impl std::fmt::Display for E {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl Error for E {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn every_cause_in_order() {
        let e = E(
            "barrier",
            Some(Box::new(E("image", Some(Box::new(E("No space", None)))))),
        );
        assert_eq!(messages(&e), ["barrier", "image", "No space"]);
        assert_eq!(chain(&e), "barrier: image: No space");
        assert_eq!(chain(&E("alone", None)), "alone");
    }
}
