//! Check.
#![allow(missing_docs)]
pub fn _y() {}
