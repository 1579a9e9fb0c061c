//! The same framework code as `beside-candle`, beside cudarc in another
//! linking mode.

include!("../../beside-candle/src/lib.rs");
