//! Whole-image operations built on [`crate::Image`]: commit, rebase,
//! compact, resize, convert and measure.
