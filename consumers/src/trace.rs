//! W3C trace context on the wire: the relay's `traceparent` header, and the
//! helpers jobledger itself uses to read and write it (this crate owns the
//! message format, so it owns this header too).
//!
//! A value must have the W3C shape before anything reads it; the ids are
//! then parsed by OpenTelemetry's own `from_hex` and written from its typed
//! ids, exactly as its propagator does (tests hold the two to the same
//! answers), without the propagator's carrier maps. Nothing here exports anything: spans only leave
//! the process when the application installed `tracing-opentelemetry`.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry::Context;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The header (and field) name, as W3C Trace Context spells it.
pub const TRACEPARENT: &str = "traceparent";

/// The remote context a `traceparent` names; `None` when it is not a valid
/// W3C trace context (a malformed value starts no trace and breaks nothing).
pub fn context_of(traceparent: &str) -> Option<Context> {
    if !well_formed(traceparent) {
        return None;
    }
    // The shape is checked, so the fields sit at fixed places; the ids are
    // parsed by OpenTelemetry's own `from_hex`, as its propagator does (a
    // test holds the two to the same answers), without the carrier map:
    // this runs several times per job.
    let sc = SpanContext::new(
        TraceId::from_hex(&traceparent[3..35]).ok()?,
        SpanId::from_hex(&traceparent[36..52]).ok()?,
        TraceFlags::new(u8::from_str_radix(&traceparent[53..55], 16).ok()?) & TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    sc.is_valid()
        .then(|| Context::current().with_remote_span_context(sc))
}

/// The W3C shape: `vv-<32 hex>-<16 hex>-ff`, lower-case hex, exactly that
/// for version 00 (a later version may add `-...`). The propagator itself
/// parses with `from_str_radix`, which takes `00-1-1-01` or a `+` sign: a
/// short id would file strangers' requests under one guessable trace.
fn well_formed(v: &str) -> bool {
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let b = v.as_bytes();
    if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return false;
    }
    let rest_ok = match &v[..2] {
        "00" => b.len() == 55,
        "ff" => false,
        _ => b.len() == 55 || b[55] == b'-',
    };
    rest_ok && hex(&v[..2], 2) && hex(&v[3..35], 32) && hex(&v[36..52], 16) && hex(&v[53..55], 2)
}

/// The `traceparent` of a context's span; `None` when it has none.
pub fn traceparent_of(cx: &Context) -> Option<String> {
    traceparent_of_span(cx.span().span_context())
}

/// The `traceparent` that names a span by its context; `None` when invalid.
pub fn traceparent_of_span(sc: &SpanContext) -> Option<String> {
    if !sc.is_valid() {
        return None;
    }
    // What the propagator's inject writes (version 00, only the sampled
    // flag), without its carrier map: this runs several times per job, and
    // formatting typed ids parses nothing (a test holds it to the propagator).
    Some(format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        (sc.trace_flags() & TraceFlags::SAMPLED).to_u8()
    ))
}

/// The `traceparent` of the nearest span, from the current one up, that
/// OpenTelemetry recorded. A span enabled only for the log (a `debug` span
/// under `RUST_LOG=debug`) has no context of its own: stopping there would
/// let the log's level decide a trace's shape. Without the layer: `None`.
pub fn current() -> Option<String> {
    let here = tracing::Span::current();
    if let Some(tp) = traceparent_of(&here.context()) {
        return Some(tp);
    }
    let id = here.id()?;
    tracing::dispatcher::get_default(|d| {
        let registry = d.downcast_ref::<tracing_subscriber::Registry>()?;
        let span = tracing_subscriber::registry::LookupSpan::span(registry, &id)?;
        span.scope().skip(1).find_map(|s| {
            tracing_opentelemetry::get_otel_context(&s.id(), d).and_then(|cx| traceparent_of(&cx))
        })
    })
}

/// Makes `span` a child of `traceparent` (call it before the span is
/// entered). Does nothing when tracing is off or the value is not valid.
pub fn adopt(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(cx) = traceparent.and_then(context_of) {
        // Fails only when the span is disabled or already started: then
        // it keeps the parent it has, which is all that could happen.
        let _ = span.set_parent(cx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use std::collections::HashMap;

    #[test]
    fn a_valid_traceparent_round_trips() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = context_of(tp).expect("valid");
        assert_eq!(traceparent_of(&cx).as_deref(), Some(tp));
    }

    /// `context_of` answers as the propagator's extract does, for every
    /// value of the W3C shape (the shape check comes first in both).
    #[test]
    fn parsing_matches_the_propagators_extract() {
        let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut inputs = vec![
            valid.to_string(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00".into(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-ff".into(),
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01".into(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01".into(),
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09-extra".into(),
            "fe-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03".into(),
        ];
        // Every one-character change of a valid value.
        for i in 0..valid.len() {
            for c in ['0', '9', 'a', 'f', 'g', 'A', '-', '+', ' '] {
                let mut v = valid.as_bytes().to_vec();
                v[i] = c as u8;
                inputs.push(String::from_utf8(v).expect("ascii"));
            }
        }
        for v in inputs {
            let ours = context_of(&v).and_then(|c| traceparent_of(&c));
            let carrier = HashMap::from([(TRACEPARENT.to_string(), v.clone())]);
            let cx = TraceContextPropagator::new().extract(&carrier);
            let theirs = (well_formed(&v) && cx.span().span_context().is_valid())
                .then(|| traceparent_of(&cx))
                .flatten();
            assert_eq!(ours, theirs, "{v}");
        }
    }

    /// The other direction of the test above, whose answers are both `None`
    /// when the shape check refuses: values the W3C grammar allows (a later
    /// version with or without more fields, any flags) are accepted, and
    /// the ones refused on purpose although the propagator takes them are
    /// named.
    #[test]
    fn the_shape_check_refuses_only_what_it_means_to() {
        let ids = "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7";
        for ok in [
            format!("00-{ids}-00"),
            format!("00-{ids}-ff"),
            format!("00-{ids}-02"),
            format!("01-{ids}-01"),
            format!("fe-{ids}-01-anything"),
            format!("f0-{ids}-01"),
        ] {
            assert!(context_of(&ok).is_some(), "{ok} is a W3C trace context");
        }
        for refused in [
            format!("0A-{ids}-01"),
            format!(" 00-{ids}-01"),
            format!("00-{ids}-01 "),
            format!("00-{ids}-01-"),
            format!("ff-{ids}-01"),
        ] {
            assert!(context_of(&refused).is_none(), "{refused} is refused");
        }
    }

    #[test]
    fn formatting_matches_the_propagators_inject() {
        use opentelemetry::trace::{SpanContext, SpanId, TraceId, TraceState};
        for (t, s, f) in [
            (1u128, 1u64, 0u8),
            (u128::MAX, u64::MAX, 1),
            (0x4bf9_2f35, 0x00f0_67aa, 0xff),
        ] {
            let sc = SpanContext::new(
                TraceId::from(t),
                SpanId::from(s),
                TraceFlags::new(f),
                true,
                TraceState::default(),
            );
            let cx = Context::new().with_remote_span_context(sc);
            let mut carrier = HashMap::new();
            TraceContextPropagator::new().inject_context(&cx, &mut carrier);
            assert_eq!(traceparent_of(&cx), carrier.remove(TRACEPARENT));
        }
    }

    #[test]
    fn malformed_values_name_no_context() {
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "\u{202e}00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-1-2-01",
            "00-+4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        ] {
            assert!(context_of(bad).is_none(), "{bad:?}");
        }
    }
}
