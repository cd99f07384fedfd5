//! The last response body a credential was rendered into, kept on the
//! credential itself.
//!
//! Why: a cache hit should cost a lookup and the write of bytes already
//! rendered. Rendering a body escapes every byte of the secret (a real
//! Entra or Google token is one to three kilobytes, an AWS session token
//! about one) and formats its numbers and dates; yet a body changes at most
//! once a second (`expires_in`), and AWS's never. So the serving layer
//! renders a body once and every other request for the same credential,
//! surface and second clones the bytes.
//!
//! The slot lives on the credential, not in a table of its own: it needs no
//! lookup, it is dropped with the credential the cache drops, and a body
//! can only ever be served for the credential it was rendered from. It
//! holds one body: the whole key (its form, the form's variant, the
//! strings the body echoes back, the second) is compared before a body is
//! reused, and a request with another key renders and replaces it. The
//! agent API's body is one form whatever surface the sidecar was asked on
//! ([`Form::Wire`]), so a pod's surfaces asking for one credential share
//! it rather than evict each other. A copy of a credential starts with an
//! empty slot.
//!
//! Only a credential asked for again keeps a body: the first body is
//! rendered and not kept, the second is kept. A node agent may hold tens
//! of thousands of credentials, each asked for once an hour by its pod's
//! SDK; a copy of each body (hundreds of bytes to kilobytes) would add
//! that much memory per entry for nothing. A credential served many times
//! (a herd, a busy pod) renders twice and then never again.
//!
//! The body holds the secret. It is zeroed when its last reference goes,
//! if that reference is the slot's (a response still being written holds
//! its own reference, and its bytes are freed as every response body is).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use zeroize::Zeroize;

use super::Surface;

/// What a body is rendered as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// An SDK surface's answer.
    Surface(Surface),
    /// The agent API's answer to a sidecar, which is the same whichever
    /// surface the sidecar was asked on: one body serves them all.
    Wire,
}

/// What a rendered body depends on besides the credential.
#[derive(Clone, Copy, Debug)]
pub struct BodyKey<'a> {
    /// What it is rendered as.
    pub form: Form,
    /// The surface's variant (a protocol version that sends other fields).
    pub variant: u8,
    /// The Unix second it was rendered in, for a body that counts down
    /// (`expires_in`); `0` for one that does not change.
    pub second: u64,
    /// The request's strings the body repeats (Azure's `resource`).
    pub echo: &'a [&'a str],
}

impl<'a> BodyKey<'a> {
    /// The key of the agent API's body, which carries absolute times only
    /// (it never changes) and repeats `echo` of the identity.
    pub const fn wire(echo: &'a [&'a str]) -> Self {
        BodyKey {
            form: Form::Wire,
            variant: 0,
            second: 0,
            echo,
        }
    }
}

impl BodyKey<'static> {
    /// The key of a body that never changes and repeats nothing of the
    /// request (the whole document comes from the credential).
    pub const fn fixed(surface: Surface, variant: u8) -> Self {
        BodyKey {
            form: Form::Surface(surface),
            variant,
            second: 0,
            echo: &[],
        }
    }
}

/// A credential's last rendered body; see the module documentation.
#[derive(Default)]
pub struct RenderedBody {
    last: ArcSwapOption<Memo>,
    /// Whether a body was rendered before (and not kept).
    rendered_before: AtomicBool,
}

struct Memo {
    form: Form,
    variant: u8,
    second: u64,
    echo: Box<[Box<str>]>,
    body: Bytes,
}

impl Memo {
    fn matches(&self, key: &BodyKey<'_>) -> bool {
        self.form == key.form
            && self.variant == key.variant
            && self.second == key.second
            && self.echo.len() == key.echo.len()
            && self.echo.iter().zip(key.echo).all(|(a, b)| **a == **b)
    }
}

impl Drop for Memo {
    fn drop(&mut self) {
        if let Ok(mut only) = std::mem::take(&mut self.body).try_into_mut() {
            only[..].zeroize();
        }
    }
}

impl RenderedBody {
    /// The body for `key`: the one rendered last when its key is `key`,
    /// else `render`'s, which replaces it.
    pub fn get_or_render<E>(
        &self,
        key: BodyKey<'_>,
        render: impl FnOnce() -> Result<Vec<u8>, E>,
    ) -> Result<Bytes, E> {
        if let Some(memo) = &*self.last.load() {
            if memo.matches(&key) {
                return Ok(memo.body.clone());
            }
        }
        let body = Bytes::from(render()?);
        if !self.rendered_before.swap(true, Ordering::Relaxed) {
            return Ok(body);
        }
        self.last.store(Some(Arc::new(Memo {
            form: key.form,
            variant: key.variant,
            second: key.second,
            echo: key.echo.iter().map(|s| Box::from(*s)).collect(),
            body: body.clone(),
        })));
        Ok(body)
    }
}

/// A copy renders its own bodies.
impl Clone for RenderedBody {
    fn clone(&self) -> Self {
        Self::default()
    }
}

/// Never the body: it holds the secret.
impl fmt::Debug for RenderedBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RenderedBody")
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::convert::Infallible;

    use super::*;

    fn key<'a>(surface: Surface, second: u64, echo: &'a [&'a str]) -> BodyKey<'a> {
        BodyKey {
            form: Form::Surface(surface),
            variant: 0,
            second,
            echo,
        }
    }

    /// Renders "`n`:`label`" and counts the renders.
    fn get(slot: &RenderedBody, key: BodyKey<'_>, renders: &Cell<u32>, label: &str) -> Bytes {
        let result: Result<Bytes, Infallible> = slot.get_or_render(key, || {
            renders.set(renders.get() + 1);
            Ok(format!("{}:{label}", renders.get()).into_bytes())
        });
        match result {
            Ok(body) => body,
        }
    }

    #[test]
    fn reuses_a_body_only_for_the_same_key() {
        let slot = RenderedBody::default();
        let renders = Cell::new(0);
        let storage = ["https://storage.azure.com/"];
        let vault = ["https://vault.azure.net"];
        // The first body is not kept: asked once, a credential holds none.
        let first = get(&slot, key(Surface::AzureImds, 100, &storage), &renders, "a");
        assert_eq!(&first[..], b"1:a");
        let second = get(&slot, key(Surface::AzureImds, 100, &storage), &renders, "b");
        assert_eq!(&second[..], b"2:b");
        // The second is: the same key gets the same bytes, not rendered again.
        let again = get(&slot, key(Surface::AzureImds, 100, &storage), &renders, "c");
        assert_eq!(&again[..], b"2:b");
        assert_eq!(renders.get(), 2);
        // Every part of the key counts.
        let next_second = get(&slot, key(Surface::AzureImds, 101, &storage), &renders, "c");
        assert_eq!(&next_second[..], b"3:c");
        let other_echo = get(&slot, key(Surface::AzureImds, 101, &vault), &renders, "d");
        assert_eq!(&other_echo[..], b"4:d");
        let other_surface = get(&slot, key(Surface::AppService, 101, &vault), &renders, "e");
        assert_eq!(&other_surface[..], b"5:e");
        let mut variant = key(Surface::AppService, 101, &vault);
        variant.variant = 1;
        assert_eq!(&get(&slot, variant, &renders, "f")[..], b"6:f");
        // Fewer echoed strings is another key, not a prefix match.
        assert_eq!(
            &get(&slot, key(Surface::AppService, 101, &[]), &renders, "g")[..],
            b"7:g"
        );
        // The last one is kept.
        assert_eq!(
            &get(&slot, key(Surface::AppService, 101, &[]), &renders, "h")[..],
            b"7:g"
        );
        assert_eq!(renders.get(), 7);
    }

    #[test]
    fn a_failed_render_keeps_nothing_and_a_copy_starts_empty() {
        let slot = RenderedBody::default();
        let failed: Result<Bytes, &str> =
            slot.get_or_render(key(Surface::Gce, 0, &[]), || Err("no"));
        assert_eq!(failed, Err("no"));
        let renders = Cell::new(0);
        for _ in 0..3 {
            get(&slot, key(Surface::Gce, 0, &[]), &renders, "x");
        }
        assert_eq!(renders.get(), 2, "the failed render counted as none");
        let copy = slot.clone();
        for _ in 0..3 {
            get(&copy, key(Surface::Gce, 0, &[]), &renders, "y");
        }
        assert_eq!(renders.get(), 4, "a copy renders and keeps its own body");
        assert_eq!(format!("{copy:?}"), "RenderedBody");
    }
}
