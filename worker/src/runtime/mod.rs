//! Everything that calls ONNX Runtime, and nothing else does: the CPU as its kernels see it
//! ([`cpu`]), sessions and their options ([`model`]), the engine that batches requests and
//! runs them on its lanes ([`engine`]), the arena runs' buffers come from ([`allocator`]), a
//! model's prepared weights, mapped by every worker ([`weights`]), and values in and out,
//! checked against what a model declares ([`tensor`]; byte strings through the C API's sized
//! buffers, [`strings`]).

pub mod allocator;
pub mod cpu;
pub mod engine;
pub mod model;
pub mod strings;
pub mod tensor;
pub mod weights;
