//! INT8 post-training quantisation and quantised inference for the fx models.
//!
//! Not started: no issue has asked for it yet, so the crate has no API. It exists so the
//! workspace layout matches the design (it sits above `fx-models`, whose trained weights it
//! will quantise) and so `fx-train`'s `cuda` feature already forwards to it.
