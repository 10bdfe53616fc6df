//! The request layer: what a handler does between the protocol surface (`http`) and the
//! runtime. [`door`]: what every request passes first, whatever its protocol (its key, limits,
//! priority, deadline, id and access line), learning the [`call::Call`] every later stage is
//! handed; [`app`]: the worker's state and request counting; [`error`]: the one error type and
//! where it becomes a status; [`model`]: what handlers ask of a model (made by
//! [`crate::load`]); [`models`]: the models it serves, loaded at boot or on demand, and their
//! lookup; [`on_demand`]: the loader thread that serves the loads on demand; [`infer`]: a
//! KServe v2 request run through the model's pipeline or its tensors; [`tasks`]: texts and
//! images through the pipeline and the engine, and the answers' shapes shared by TEI, OpenAI
//! and v2; [`cache`]: the answers already computed; [`link`]: the socketpair to the
//! supervisor, its reports and the questions only it answers.

pub mod app;
pub mod cache;
pub mod call;
pub mod door;
pub mod error;
pub mod infer;
pub mod link;
pub mod model;
pub mod models;
pub mod on_demand;
pub mod placement;
pub mod tasks;
