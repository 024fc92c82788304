//! Which requests a web page may make. A server on loopback without `--api-key` is open to
//! every page the machine's browser shows: a page can post to it blind (the browser sends a
//! "simple" cross-origin request without asking), and a page whose host name is made to
//! resolve to 127.0.0.1 (DNS rebinding) can even read its answers. Three checks close that:
//!
//! - `Host` must name the bound address (or a loopback name, or a name `--allow-host` gives)
//!   with the bound port: a rebound page sends its own host name.
//! - `Origin`, which browsers send on every cross-origin request and on every POST, must be
//!   the server's own or one `--allow-origin` gives; allowed origins get CORS headers.
//! - POST bodies must be `application/json`: a form or a `no-cors` fetch cannot send that
//!   type without the browser asking first (a preflight, which the Origin check answers).
//!
//! Clients that are not browsers (curl, OpenAI's SDKs) send the right Host, no Origin and
//! `application/json`, and pass.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// The hosts and origins requests may name.
#[derive(Clone, Debug)]
pub struct Access {
    bound: SocketAddr,
    /// `--allow-host`: host names (any port of `bound`'s) or `name:port`, lowercase; `*`
    /// allows every host.
    hosts: Vec<String>,
    /// `--allow-origin`: `scheme://host[:port]`, lowercase; `*` allows every origin.
    origins: Vec<String>,
}

impl Access {
    pub fn new(bound: SocketAddr, hosts: &[String], origins: &[String]) -> Self {
        let clean = |v: &[String]| -> Vec<String> {
            v.iter()
                .map(|s| s.trim().trim_end_matches('/').to_ascii_lowercase())
                .collect()
        };
        Self {
            bound,
            hosts: clean(hosts),
            origins: clean(origins),
        }
    }

    /// Whether an authority (`host[:port]`, as in `Host` or an origin) names this server.
    fn is_own(&self, authority: &str, default_port: u16) -> bool {
        let authority = authority.to_ascii_lowercase();
        if self.hosts.iter().any(|h| h == "*" || *h == authority) {
            return true;
        }
        let Some((name, port)) = split_authority(&authority, default_port) else {
            return false;
        };
        if port != self.bound.port() {
            return false;
        }
        if self.hosts.iter().any(|h| h == name) || name == "localhost" {
            return true;
        }
        match name
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            // Bound to every interface: any of the machine's addresses may be used, and an
            // address literal cannot be rebound to another site.
            Ok(ip) => ip.is_loopback() || ip == self.bound.ip() || self.bound.ip().is_unspecified(),
            Err(_) => false,
        }
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        let origin = origin.trim_end_matches('/').to_ascii_lowercase();
        if self.origins.iter().any(|o| o == "*" || *o == origin) {
            return true;
        }
        // The server's own origin (a page it could serve itself).
        match origin.strip_prefix("http://") {
            Some(authority) => self.is_own(authority, 80),
            None => false,
        }
    }

    /// The request refused, naming the header; else the origin to answer with CORS headers.
    fn check(&self, method: &Method, headers: &HeaderMap) -> Result<Option<HeaderValue>, ApiError> {
        let text = |name: header::HeaderName| {
            headers
                .get(&name)
                .map(|v| v.to_str().map(str::to_string).unwrap_or_default())
        };
        // HTTP/1.0 clients may send no Host; browsers always send one.
        if let Some(host) = text(header::HOST)
            && !self.is_own(&host, 80)
        {
            return Err(forbidden(
                "Host",
                format!(
                    "header Host: expected this server's address ({}, or a loopback name, with \
                     port {}), found {host:?}; start the server with --allow-host NAME to \
                     accept another name",
                    self.bound.ip(),
                    self.bound.port()
                ),
            ));
        }
        let origin = match text(header::ORIGIN) {
            Some(origin) if !self.origin_allowed(&origin) => {
                return Err(forbidden(
                    "Origin",
                    format!(
                        "header Origin: expected this server's own origin or one given with \
                         --allow-origin, found {origin:?}; web pages may call this server only \
                         when it allows their origin"
                    ),
                ));
            }
            Some(_) => headers.get(header::ORIGIN).cloned(),
            None => None,
        };
        if method == Method::POST {
            let content_type = text(header::CONTENT_TYPE);
            let json = content_type.as_deref().is_some_and(|t| {
                t.split(';')
                    .next()
                    .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
            });
            if !json {
                let mut e = ApiError::status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "invalid_request_error",
                    "unsupported_media_type",
                    format!(
                        "header Content-Type: expected application/json, found {}",
                        content_type.map_or("none".to_string(), |t| format!("{t:?}"))
                    ),
                );
                e.param = Some("Content-Type".into());
                return Err(e);
            }
        }
        Ok(origin)
    }
}

/// `host[:port]` as (host, port); IPv6 literals keep their brackets.
fn split_authority(authority: &str, default_port: u16) -> Option<(&str, u16)> {
    let (name, port) = if let Some(rest) = authority.strip_prefix('[') {
        let end = rest.find(']')?;
        let after = &rest[end + 1..];
        let name = &authority[..end + 2];
        match after.strip_prefix(':') {
            Some(p) => (name, p),
            None if after.is_empty() => (name, ""),
            None => return None,
        }
    } else {
        match authority.rsplit_once(':') {
            Some((n, p)) => (n, p),
            None => (authority, ""),
        }
    };
    let port = if port.is_empty() {
        default_port
    } else {
        port.parse().ok()?
    };
    (!name.is_empty()).then_some((name, port))
}

fn forbidden(header_name: &str, message: String) -> ApiError {
    let mut e = ApiError::status(
        StatusCode::FORBIDDEN,
        "invalid_request_error",
        "forbidden_header",
        message,
    );
    e.param = Some(header_name.into());
    e
}

/// The middleware: refuses what `Access::check` refuses (counted as rejected), answers
/// preflights of allowed origins, and adds CORS headers for them.
pub async fn guard(
    State(app): State<Arc<crate::routes::App>>,
    request: Request,
    next: Next,
) -> Response {
    let origin = match app.access.check(request.method(), request.headers()) {
        Ok(o) => o,
        Err(e) => {
            app.shared.metrics.count("rejected");
            return e.into_response();
        }
    };
    if request.method() == Method::OPTIONS
        && let Some(origin) = &origin
    {
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
        return r;
    }
    let mut response = next.run(request).await;
    if let Some(origin) = origin {
        let h = response.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn hosts_must_name_the_bound_address_or_an_allowed_name() {
        let loopback = Access::new("127.0.0.1:8080".parse().unwrap(), &[], &[]);
        let every = Access::new(
            "0.0.0.0:8080".parse().unwrap(),
            &["gpu-box.lan".into()],
            &[],
        );
        for (access, host, ok) in [
            (&loopback, "127.0.0.1:8080", true),
            (&loopback, "localhost:8080", true),
            (&loopback, "LOCALHOST:8080", true),
            (&loopback, "[::1]:8080", true),
            (&loopback, "127.0.0.1:8081", false),
            (&loopback, "127.0.0.1", false),
            (&loopback, "attacker.example:8080", false),
            (&loopback, "10.0.0.5:8080", false),
            (&loopback, "[::1", false),
            (&every, "10.0.0.5:8080", true),
            (&every, "gpu-box.lan:8080", true),
            (&every, "gpu-box.lan:9000", false),
            (&every, "attacker.example:8080", false),
        ] {
            let got = access.check(&Method::GET, &headers(&[("host", host)]));
            assert_eq!(got.is_ok(), ok, "{host} on {:?}", access.bound);
            if let Err(e) = got {
                assert_eq!(e.status, StatusCode::FORBIDDEN);
                assert_eq!(e.param.as_deref(), Some("Host"));
            }
        }
    }

    #[test]
    fn origins_are_refused_unless_allowed_and_posts_must_be_json() {
        let a = Access::new(
            "127.0.0.1:8080".parse().unwrap(),
            &[],
            &["https://app.example/".into()],
        );
        let post = |pairs: &[(&'static str, &str)]| {
            let mut all = vec![
                ("host", "127.0.0.1:8080"),
                ("content-type", "application/json"),
            ];
            all.extend_from_slice(pairs);
            a.check(&Method::POST, &headers(&all))
        };
        assert_eq!(post(&[]), Ok(None));
        assert!(
            post(&[("origin", "https://app.example")])
                .unwrap()
                .is_some()
        );
        assert!(post(&[("origin", "http://localhost:8080")]).is_ok());
        for origin in ["https://evil.example", "null", "http://localhost:3000"] {
            let e = post(&[("origin", origin)]).unwrap_err();
            assert_eq!(
                (e.status, e.param.as_deref()),
                (StatusCode::FORBIDDEN, Some("Origin")),
                "{origin}"
            );
        }
        let form = a
            .check(
                &Method::POST,
                &headers(&[
                    ("host", "127.0.0.1:8080"),
                    ("content-type", "application/x-www-form-urlencoded"),
                ]),
            )
            .unwrap_err();
        assert_eq!(form.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert!(form.message.contains("application/x-www-form-urlencoded"));
    }
}
