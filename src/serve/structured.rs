//! `response_format` (`json_object`, `json_schema`) on both endpoints: the grammar compiled
//! off the async workers into the [`Constraint`] a request's sequence follows. The model's
//! [`Grammars`] are built at the first such request (about 0.2 s and 27 MB for a 49k
//! vocabulary), so a server that never sees one never pays for them.

use super::checks;
use super::error::ApiError;
use super::openai::Params;
use super::routes::{off_workers, Shared};
use crate::grammar::{Constraint, Grammars};

/// The request's constraint, if its `response_format` asks for one; a 400 naming
/// `response_format` for one that does not compile.
pub async fn constraint(s: &Shared, p: &Params) -> Result<Option<Constraint>, ApiError> {
    let Some(spec) = checks::response_format(p.response_format.as_ref())? else {
        return Ok(None);
    };
    // Compiling costs up to a few ms of a blocking thread: not for a request that the full
    // queue would refuse anyway.
    if s.queue.full() {
        return Err(ApiError::busy(s.queue.capacity));
    }
    let field = "response_format";
    off_workers(s, move |s| {
        let grammars = s.grammars.get_or_init(|| {
            Grammars::new(s.tokenizer.inner(), s.vocab_size, &s.eos).map_err(|e| e.to_string())
        });
        let grammars = grammars
            .as_ref()
            .map_err(|e| ApiError::bad_field(field, e.clone()))?;
        let constraint = grammars
            .compile(&spec)
            .map_err(|e| ApiError::bad_field(field, e.to_string()))?;
        Ok(Some(constraint))
    })
    .await
}
