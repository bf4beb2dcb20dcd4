//! The process-wide allocator that the C ABI and PyTorch use: created on first use from
//! `configure_global`'s configuration or else `STEPALLOC_CONF`, and never dropped. Creating it
//! also starts its metrics endpoint when `metrics_addr` is set. Layer: above `allocator` and
//! `metrics` (which both know nothing of it).

use crate::allocator::Allocator;
use crate::config::Config;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::sync::{Arc, OnceLock};

static GLOBAL: OnceLock<Arc<Allocator>> = OnceLock::new();
static GLOBAL_INIT: Mutex<Option<Config>> = Mutex::new(None);

/// Sets the configuration of the process-wide allocator from a string. Only before its first
/// use: afterwards the configuration is fixed and this is an error.
pub fn configure_global(text: &str) -> Result<()> {
    let config = Config::parse_from(text, "the string given to stepalloc_configure")?;
    let mut pending = GLOBAL_INIT.lock();
    if GLOBAL.get().is_some() {
        return Err(Error::InvalidArgument(
            "stepalloc is already initialised; configure it before the first allocation".into(),
        ));
    }
    *pending = Some(config);
    Ok(())
}

/// The process-wide allocator, created on first use from `configure_global`'s configuration
/// or else `STEPALLOC_CONF`. Never dropped: PyTorch may free tensors while the process exits.
#[inline]
pub fn global() -> Result<&'static Arc<Allocator>> {
    if let Some(a) = GLOBAL.get() {
        return Ok(a);
    }
    init_global()
}

#[cold]
fn init_global() -> Result<&'static Arc<Allocator>> {
    let pending = GLOBAL_INIT.lock();
    if let Some(a) = GLOBAL.get() {
        return Ok(a);
    }
    let config = match pending.as_ref() {
        Some(c) => c.clone(),
        None => Config::from_env()?,
    };
    let allocator = Arc::new(Allocator::new(config)?);
    let _ = GLOBAL.set(allocator);
    let allocator = GLOBAL.get().ok_or_else(|| Error::Unavailable("process-wide allocator could not be set".into()))?;
    // `metrics_addr`: serve the endpoint; a failure is logged and allocation goes on.
    crate::metrics::start_for_global(allocator);
    Ok(allocator)
}

/// The process-wide allocator if it exists already (never creates it).
pub fn global_if_initialised() -> Option<&'static Arc<Allocator>> {
    GLOBAL.get()
}
