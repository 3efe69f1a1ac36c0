//! Whole-image operations.
#![allow(missing_docs)]
pub fn _x() {}
