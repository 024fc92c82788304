//! `unmask serve` as a process: signals, slow and idle clients, the connection cap, the
//! Host/Origin/Content-Type checks and the queue bound, over raw TCP (what a slow or
//! hostile client sends is exactly what these tests write). The OpenAI client and every
//! error shape are tested by tools/serve_test.py (scripts/test-server.sh).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{unmask, workspace};

mod dgemma;
mod score;

/// A running `unmask serve --port 0` on the bundled model, its stderr collected.
struct Server {
    child: Child,
    port: u16,
    stderr: Arc<Mutex<String>>,
}

impl Server {
    fn start(extra: &[&str]) -> Self {
        Self::start_limited(extra, None)
    }

    /// With `descriptors`: under `ulimit -n` of that many open files.
    fn start_limited(extra: &[&str], descriptors: Option<u32>) -> Self {
        Self::start_model(&workspace().join("models/tiny"), extra, descriptors)
    }

    fn start_model(model: &std::path::Path, extra: &[&str], descriptors: Option<u32>) -> Self {
        let mut command = unmask();
        if let Some(n) = descriptors {
            let mut wrapped = std::process::Command::new("bash");
            wrapped
                .args(["-c", &format!("ulimit -n {n} && exec \"$@\""), "bash"])
                .arg(command.get_program());
            for (k, v) in command.get_envs() {
                if let Some(v) = v {
                    wrapped.env(k, v);
                }
            }
            command = wrapped;
        }
        let mut child = command
            .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn unmask serve");
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&stderr);
        let mut err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("read the first line");
        let port = line
            .trim()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| {
                let _ = child.kill();
                panic!(
                    "no `listening on` line: {line:?}\n{}",
                    stderr.lock().unwrap()
                )
            });
        Self {
            child,
            port,
            stderr,
        }
    }

    fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s
    }

    /// One request on a new connection (closed after it): (status, body).
    fn request(&self, method: &str, path: &str, headers: &[&str], body: &str) -> (u16, String) {
        Port(self.port).request(method, path, headers, body)
    }

    fn signal(&self, name: &str) {
        let ok = std::process::Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{name}");
    }

    /// Waits up to `limit` for the process to exit: its exit status and the time it took.
    fn wait_exit(&mut self, limit: Duration) -> Option<(std::process::ExitStatus, Duration)> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some((status, start.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Whether the server logs every one of `lines` within 5 s: a log line can reach the
    /// collecting thread after the client saw what the server did.
    fn logs(&self, lines: &[&str]) -> bool {
        let start = Instant::now();
        loop {
            let err = self.stderr();
            if lines.iter().all(|l| err.contains(l)) {
                return true;
            }
            if start.elapsed() > Duration::from_secs(5) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A connection that sent half a request head, and one that sent its head and part of a
/// body: neither ever finishes.
fn half_sent_requests(server: &Server) -> [TcpStream; 2] {
    let mut head = server.connect();
    head.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        .unwrap();
    let mut body = server.connect();
    let start = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: \
         application/json\r\nContent-Length: 1000\r\n\r\n{{\"prompt\": \"a",
        server.port
    );
    body.write_all(start.as_bytes()).unwrap();
    // Time for both to reach the server (and the second to reach its handler).
    std::thread::sleep(Duration::from_millis(300));
    [head, body]
}

#[test]
fn sigterm_with_half_sent_requests_exits_within_the_grace_period() {
    let grace = 1.5;
    let mut server = Server::start(&[
        "--shutdown-grace",
        &grace.to_string(),
        "--header-timeout",
        "60",
        "--body-timeout",
        "60",
    ]);
    let _held = half_sent_requests(&server);
    server.signal("TERM");
    let (status, took) = server
        .wait_exit(Duration::from_secs(20))
        .expect("the server still runs 20 s after SIGTERM");
    let err = server.stderr();
    assert!(status.success(), "exit {status:?}\n{err}");
    // It waited for the slow clients (the grace period), then closed them and exited.
    assert!(
        took.as_secs_f64() >= grace - 0.1 && took.as_secs_f64() < grace + 3.0,
        "exited {took:?} after SIGTERM with a grace period of {grace} s\n{err}"
    );
    assert!(
        err.contains("2 connection(s) still open after the grace period"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_second_signal_ends_the_shutdown_at_once() {
    let mut server = Server::start(&["--shutdown-grace", "60", "--header-timeout", "60"]);
    let _held = half_sent_requests(&server);
    server.signal("TERM");
    // The first signal waits for the slow clients...
    assert!(
        server.wait_exit(Duration::from_millis(500)).is_none(),
        "exited at once despite a 60 s grace period and open connections"
    );
    // ...the second does not.
    server.signal("INT");
    let (status, took) = server
        .wait_exit(Duration::from_secs(10))
        .expect("still running 10 s after the second signal");
    let err = server.stderr();
    assert!(status.success(), "exit {status:?}\n{err}");
    assert!(took < Duration::from_secs(3), "{took:?}\n{err}");
    assert!(err.contains("a second signal"), "{err}");
}

#[test]
fn slow_and_idle_connections_are_timed_out_and_capped_while_health_answers() {
    let cap = 8;
    let server = Server::start(&[
        "--max-connections",
        &cap.to_string(),
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
    ]);
    // A burst of idle connections and of half-sent heads, five times the cap.
    let mut burst: Vec<TcpStream> = (0..5 * cap).map(|_| server.connect()).collect();
    for s in burst.iter_mut().step_by(2) {
        s.write_all(b"GET /heal").unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    let (status, body) = server.request("GET", "/health", &[], "");
    assert_eq!(status, 200, "/health during the burst: {body}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "/health took {:?}",
        start.elapsed()
    );
    assert!(
        server.logs(&[&format!("connection cap of {cap} reached")]),
        "the cap is logged:\n{}",
        server.stderr()
    );
    // Past the cap, the oldest idle connections were closed: the first ones read EOF.
    let mut buf = [0u8; 16];
    assert_eq!(burst[1].read(&mut buf).ok(), Some(0), "evicted");
    drop(burst);

    // An idle connection alone: closed by the header timeout (1 s), not before.
    let mut idle = server.connect();
    let start = Instant::now();
    let n = idle.read(&mut buf).unwrap_or(0);
    let waited = start.elapsed();
    assert_eq!(n, 0, "the idle connection got bytes");
    assert!(
        waited >= Duration::from_millis(800) && waited < Duration::from_secs(5),
        "an idle connection closed after {waited:?} with --header-timeout 1"
    );
    assert!(
        server.logs(&["(idle or slow; --header-timeout)"]),
        "the timeout is logged:\n{}",
        server.stderr()
    );

    // A body that stops halfway: 408 after the body timeout.
    let mut slow = server.connect();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: \
         application/json\r\nContent-Length: 1000\r\n\r\n{{\"prompt\"",
        server.port
    );
    slow.write_all(head.as_bytes()).unwrap();
    let start = Instant::now();
    let mut reply = String::new();
    let _ = slow.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(reply.contains("--body-timeout"), "{reply}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    let (status, _) = server.request("GET", "/health", &[], "");
    assert_eq!(status, 200, "still serving");
}

/// 120 idle connections against a limit of 96 open files: `accept` fails (EMFILE), the
/// server closes the oldest idle connection to free a descriptor, says so, and `/health`
/// answers.
#[test]
fn out_of_descriptors_idle_connections_make_room_and_health_answers() {
    let server = Server::start_limited(&["--header-timeout", "30"], Some(96));
    let burst: Vec<TcpStream> = (0..120)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", server.port)).ok())
        .collect();
    assert!(burst.len() > 96, "{} connections", burst.len());
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    let (status, body) = server.request("GET", "/health", &[], "");
    assert_eq!(status, 200, "{body}\n{}", server.stderr());
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    assert!(
        server.logs(&["Too many open files", "closed the oldest idle one"]),
        "{}",
        server.stderr()
    );
}

#[test]
fn foreign_hosts_origins_and_content_types_are_refused_unless_allowed() {
    let server = Server::start(&["--allow-origin", "http://localhost:3000"]);
    let port = server.port;
    let chat = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"steps":4,"block_length":4}"#;
    let json = "Content-Type: application/json";
    let refused = [
        (vec!["Host: evil.example:80".to_string()], 403, "Host"),
        (vec![format!("Host: evil.example:{port}")], 403, "Host"),
        (
            vec![format!("Host: 127.0.0.1:{}", port.wrapping_add(1))],
            403,
            "Host",
        ),
        (
            vec!["Origin: http://evil.example".to_string()],
            403,
            "Origin",
        ),
        (vec!["Origin: null".to_string()], 403, "Origin"),
        (
            vec!["Content-Type: text/plain".to_string()],
            415,
            "Content-Type",
        ),
        (vec![], 415, "Content-Type"),
    ];
    for (headers, want, param) in refused {
        let mut h: Vec<&str> = headers.iter().map(String::as_str).collect();
        if param != "Content-Type" {
            h.push(json);
        }
        let (status, body) = server.request("POST", "/v1/chat/completions", &h, chat);
        assert_eq!(status, want, "{headers:?}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("error JSON");
        assert_eq!(v["error"]["param"], param, "{body}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(param),
            "{body}"
        );
    }
    // Allowed: loopback names with the bound port, the allowed origin (with CORS headers).
    for headers in [
        vec![format!("Host: localhost:{port}"), json.to_string()],
        vec![format!("Host: [::1]:{port}"), json.to_string()],
        vec![
            "Origin: http://localhost:3000".to_string(),
            "content-type: Application/JSON; charset=utf-8".to_string(),
        ],
    ] {
        let h: Vec<&str> = headers.iter().map(String::as_str).collect();
        let (status, body) = server.request("POST", "/v1/chat/completions", &h, chat);
        assert_eq!(status, 200, "{headers:?}: {body}");
    }
    let (status, _) = server.request("GET", "/health", &["Origin: http://evil.example"], "");
    assert_eq!(status, 403, "/health is checked too");
    let mut s = server.connect();
    let preflight = format!(
        "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nOrigin: \
         http://localhost:3000\r\nAccess-Control-Request-Method: POST\r\nConnection: close\r\n\r\n"
    );
    s.write_all(preflight.as_bytes()).unwrap();
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    let lower = reply.to_ascii_lowercase();
    assert!(lower.starts_with("http/1.1 204"), "{reply}");
    assert!(
        lower.contains("access-control-allow-origin: http://localhost:3000"),
        "{reply}"
    );
}

#[test]
fn the_queue_never_exceeds_max_queue_with_shared_prefix_requests() {
    let max_queue = 2;
    // Batch rows for about one request at a time: the others wait in the session.
    let server = Server::start(&["--max-queue", &max_queue.to_string(), "--batch-rows", "96"]);
    let port = server.port;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let depths = Arc::new(Mutex::new(Vec::<f64>::new()));
    let watcher = {
        let (stop, depths) = (Arc::clone(&stop), Arc::clone(&depths));
        let probe = Server::probe(port);
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(d) = probe() {
                    depths.lock().unwrap().push(d);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let body = r#"{"messages":[{"role":"system","content":"You answer in one word."},{"role":"user","content":"Name a city."}],"max_tokens":32,"steps":32,"block_length":32,"cache":"bicache-dual"}"#;
    let senders: Vec<_> = (0..16)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(30));
            std::thread::spawn(move || {
                let json = ["Content-Type: application/json"];
                Port(port)
                    .request("POST", "/v1/chat/completions", &json, body)
                    .0
            })
        })
        .collect();
    let codes: Vec<u16> = senders.into_iter().map(|t| t.join().unwrap()).collect();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    watcher.join().unwrap();
    let depths = depths.lock().unwrap().clone();
    let deepest = depths.iter().copied().fold(0.0, f64::max);
    assert!(
        codes.iter().all(|c| *c == 200 || *c == 429),
        "{codes:?}\n{}",
        server.stderr()
    );
    assert!(codes.contains(&429) && codes.contains(&200), "{codes:?}");
    assert!(!depths.is_empty(), "no metrics read");
    assert!(
        deepest <= max_queue as f64,
        "the queue reached {deepest} with --max-queue {max_queue}"
    );
}

/// What a test thread needs of a server it does not own: its port.
struct Port(u16);

impl Server {
    /// Reads `unmask_queue_depth` from /metrics.
    fn probe(port: u16) -> impl Fn() -> Option<f64> {
        move || {
            let (status, text) = Port(port).request("GET", "/metrics", &[], "");
            (status == 200).then_some(())?;
            text.lines()
                .find_map(|l| l.strip_prefix("unmask_queue_depth "))
                .and_then(|v| v.trim().parse().ok())
        }
    }
}

impl Port {
    fn request(&self, method: &str, path: &str, headers: &[&str], body: &str) -> (u16, String) {
        let mut s = TcpStream::connect(("127.0.0.1", self.0)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        if !headers
            .iter()
            .any(|h| h.to_ascii_lowercase().starts_with("host:"))
        {
            head += &format!("Host: 127.0.0.1:{}\r\n", self.0);
        }
        for h in headers {
            head += h;
            head += "\r\n";
        }
        head += "\r\n";
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body.as_bytes()).unwrap();
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        let status = reply
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = reply
            .split_once("\r\n\r\n")
            .map_or("", |(_, b)| b)
            .to_string();
        (status, body)
    }
}

/// ACache through the server: questions of one table after different role lines share the
/// table's span entry (a miss, then hits, counted in /metrics), and each answer equals
/// `unmask generate`'s for the same prompt with the span in an affix file.
#[test]
fn requests_sharing_a_span_hit_its_entry_and_answer_as_generate() {
    let root = workspace();
    let set = std::fs::read_to_string(root.join("data/tasks/heldout-affix-small.jsonl")).unwrap();
    let items: Vec<serde_json::Value> = set
        .lines()
        .take(3)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let server = Server::start(&[]);
    let dir = std::env::temp_dir().join(format!("unmask-affix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut hits = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let f = |k: &str| item[k].as_str().unwrap().to_string();
        let body = serde_json::json!({
            "messages": [
                {"role": "system", "content": f("system")},
                {"role": "user", "content": f("user")},
            ],
            "max_tokens": 32, "steps": 16, "block_length": 4,
            "cache": "acache", "affix": f("affix"),
        });
        let (status, reply) = server.request(
            "POST",
            "/v1/chat/completions",
            &["Content-Type: application/json"],
            &body.to_string(),
        );
        assert_eq!(status, 200, "{reply}\n{}", server.stderr());
        let v: serde_json::Value = serde_json::from_str(&reply).expect("JSON reply");
        let report = &v["unmask"]["acache"];
        assert!(report["fallback"].is_null(), "{report}");
        hits.push(report["hit"].as_bool().unwrap());
        let served = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        // The same prompt from the CLI: the system prompt's role line, then the affix file
        // at its marker.
        let affix = dir.join(format!("affix-{i}.txt"));
        std::fs::write(&affix, f("affix")).unwrap();
        let preamble = f("system").strip_suffix(&f("affix")).unwrap().to_string();
        let out = unmask()
            .args([
                "generate",
                "--model",
                root.join("models/tiny").to_str().unwrap(),
            ])
            .args([
                "--system",
                &format!("{preamble}{{affix}}"),
                "--prompt",
                &f("user"),
            ])
            .args(["--affix-file", affix.to_str().unwrap(), "--cache", "acache"])
            .args(["--gen-length", "32", "--steps", "16", "--block-length", "4"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let generated = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert_eq!(
            served.trim(),
            generated,
            "item {i}: served and generated answers differ"
        );
    }
    assert_eq!(hits, [false, true, true], "one entry for the shared table");
    let (_, metrics) = server.request("GET", "/metrics", &[], "");
    let value = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    assert_eq!(value("unmask_acache_hits_total "), Some(2.0), "{metrics}");
    assert_eq!(value("unmask_acache_misses_total "), Some(1.0));
    assert!(value("unmask_acache_anchors_total ").is_some_and(|a| a > 0.0));
    let _ = std::fs::remove_dir_all(&dir);
}

/// OpenAI's completion `suffix`: the canvas is infilled before it, the answer is the text
/// `unmask generate --suffix` gives, and the suffix counts as prompt tokens.
#[test]
fn a_completion_with_a_suffix_answers_as_generate() {
    let root = workspace();
    let fixture = root.join("tests/fixtures/tiny");
    let text = std::fs::read_to_string(fixture.join("goldens/infill.json")).unwrap();
    let goldens: serde_json::Value = serde_json::from_str(&text).unwrap();
    let case = &goldens["cases"][0];
    let (prompt, suffix) = (&case["prompt"], case["suffix_text"].as_str().unwrap());
    let server = Server::start_model(&fixture, &[], None);
    let body = serde_json::json!({
        "prompt": prompt, "suffix": suffix, "max_tokens": 8, "steps": 8,
        "block_length": 8, "cache": "none", "full_canvas": true,
    });
    let (status, reply) = server.request(
        "POST",
        "/v1/completions",
        &["Content-Type: application/json"],
        &body.to_string(),
    );
    assert_eq!(status, 200, "{reply}\n{}", server.stderr());
    let v: serde_json::Value = serde_json::from_str(&reply).expect("JSON reply");
    let served = v["choices"][0]["text"].as_str().unwrap();
    let suffix_ids = case["suffix"].as_array().unwrap().len();
    assert_eq!(
        v["usage"]["prompt_tokens"],
        prompt.as_array().unwrap().len() + suffix_ids
    );
    let ids = prompt
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let out = unmask()
        .args(["generate", "--model", fixture.to_str().unwrap()])
        .args([
            "--prompt-ids",
            &ids,
            "--suffix",
            suffix,
            "--full-canvas",
            "--json",
        ])
        .args(["--gen-length", "8", "--steps", "8", "--block-length", "8"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(generated["suffix_len"], suffix_ids);
    assert_eq!(served, generated["text"].as_str().unwrap());
    // A chat has no suffix.
    let chat = r#"{"messages":[{"role":"user","content":"q"}],"suffix":"z"}"#;
    let (status, reply) = server.request(
        "POST",
        "/v1/chat/completions",
        &["Content-Type: application/json"],
        chat,
    );
    assert_eq!(status, 400, "{reply}");
    assert!(reply.contains("\"param\":\"suffix\""), "{reply}");
}
