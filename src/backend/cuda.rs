//! The CUDA backend: cudarc's driver API. Filled in by the CUDA backend work; until then
//! `open` reports that CUDA is not available, and `backend:sim` serves every machine.

use super::Backend;
use crate::error::{Error, Result};

/// Opens every CUDA device, or says why it cannot.
pub fn open_all() -> Result<Vec<Box<dyn Backend>>> {
    Err(Error::Unavailable("the CUDA backend is not built in this version; use backend:sim".into()))
}
