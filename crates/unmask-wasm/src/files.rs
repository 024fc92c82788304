//! `ModelFiles` in a browser: a model folder on a web server (`fetch`, the body read as a
//! stream) or files a person picked (`File`, read in slices). Files already in memory are
//! `unmask::MemoryFiles`, shared with native code.

use std::collections::HashMap;

use js_sys::{Reflect, Uint8Array};
use unmask::{EngineError, ModelFiles};
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use web_sys::{Headers, ReadableStreamDefaultReader, RequestInit, Response};

/// Bytes of a picked file read at a time.
const SLICE_BYTES: f64 = (16 << 20) as f64;

/// A JavaScript exception as an engine error about `location`.
fn js_error(location: &str, e: JsValue) -> EngineError {
    let message = e
        .dyn_ref::<js_sys::Error>()
        .map(|e| String::from(e.message()))
        .or_else(|| e.as_string())
        .unwrap_or_else(|| format!("{e:?}"));
    EngineError::File {
        location: location.to_string(),
        message,
    }
}

/// `fetch(url)` from a page or a worker, with an optional `Range` header.
async fn fetch(url: &str, range: Option<String>) -> Result<Response, EngineError> {
    let err = |e| js_error(url, e);
    let init = RequestInit::new();
    if let Some(r) = range {
        let headers = Headers::new().map_err(err)?;
        headers.set("Range", &r).map_err(err)?;
        init.set_headers(&headers);
    }
    let global = js_sys::global();
    let promise = match global.dyn_ref::<web_sys::Window>() {
        Some(w) => w.fetch_with_str_and_init(url, &init),
        None => global
            .unchecked_into::<web_sys::WorkerGlobalScope>()
            .fetch_with_str_and_init(url, &init),
    };
    let response = JsFuture::from(promise).await.map_err(err)?;
    response.dyn_into::<Response>().map_err(err)
}

/// Reads a response body chunk by chunk.
struct BodyReader {
    url: String,
    reader: ReadableStreamDefaultReader,
}

impl BodyReader {
    fn new(url: &str, response: &Response) -> Result<Self, EngineError> {
        let body = response.body().ok_or_else(|| EngineError::File {
            location: url.to_string(),
            message: "the response has no body".into(),
        })?;
        Ok(Self {
            url: url.to_string(),
            reader: body.get_reader().unchecked_into(),
        })
    }

    /// The next chunk, or None at the end.
    async fn next(&self) -> Result<Option<Uint8Array>, EngineError> {
        let err = |e| js_error(&self.url, e);
        let result = JsFuture::from(self.reader.read()).await.map_err(err)?;
        let done = Reflect::get(&result, &"done".into())
            .map_err(err)?
            .as_bool()
            .unwrap_or(true);
        if done {
            return Ok(None);
        }
        let value = Reflect::get(&result, &"value".into()).map_err(err)?;
        Ok(Some(value.dyn_into::<Uint8Array>().map_err(err)?))
    }

    /// Stops the download (the rest of the body is not needed).
    fn cancel(&self) {
        let _ = self.reader.cancel();
    }
}

/// A model folder served over HTTP: `base` is its URL, ending with `/`.
pub struct UrlFiles {
    base: String,
}

impl UrlFiles {
    pub fn new(base: &str) -> Self {
        let mut base = base.to_string();
        if !base.ends_with('/') {
            base.push('/');
        }
        Self { base }
    }

    fn url(&self, name: &str) -> String {
        format!("{}{name}", self.base)
    }

    /// A response that must be a success (206 for a honoured range, 200 otherwise).
    async fn get(&self, name: &str, range: Option<String>) -> Result<Response, EngineError> {
        let url = self.url(name);
        let r = fetch(&url, range).await?;
        if !r.ok() {
            return Err(EngineError::File {
                location: url,
                message: format!("HTTP {} {}", r.status(), r.status_text()),
            });
        }
        Ok(r)
    }
}

/// The length of the whole file a response is (part of): from `Content-Range` for a
/// range, else `Content-Length`.
fn file_length(r: &Response) -> Option<u64> {
    let h = r.headers();
    if r.status() == 206 {
        let range = h.get("Content-Range").ok()??;
        return range.rsplit('/').next()?.trim().parse().ok();
    }
    h.get("Content-Length").ok()??.trim().parse().ok()
}

impl ModelFiles for UrlFiles {
    fn location(&self, name: &str) -> String {
        self.url(name)
    }

    async fn read(&mut self, name: &str) -> Result<Option<Vec<u8>>, EngineError> {
        let url = self.url(name);
        let r = fetch(&url, None).await?;
        if r.status() == 404 {
            return Ok(None);
        }
        if !r.ok() {
            return Err(EngineError::File {
                location: url,
                message: format!("HTTP {} {}", r.status(), r.status_text()),
            });
        }
        let buffer = JsFuture::from(r.array_buffer().map_err(|e| js_error(&url, e))?)
            .await
            .map_err(|e| js_error(&url, e))?;
        Ok(Some(Uint8Array::new(&buffer).to_vec()))
    }

    async fn read_head(
        &mut self,
        name: &str,
        len: usize,
    ) -> Result<(Vec<u8>, Option<u64>), EngineError> {
        // A server that ignores the range sends the whole file: read what is needed, then
        // cancel the rest of the download.
        let r = self
            .get(name, Some(format!("bytes=0-{}", len.max(1) - 1)))
            .await?;
        let length = file_length(&r);
        let reader = BodyReader::new(&self.url(name), &r)?;
        let mut head = Vec::with_capacity(len);
        while head.len() < len {
            let Some(chunk) = reader.next().await? else {
                break;
            };
            let take = (len - head.len()).min(chunk.length() as usize);
            head.extend_from_slice(&chunk.subarray(0, take as u32).to_vec());
        }
        reader.cancel();
        Ok((head, length))
    }

    async fn stream(
        &mut self,
        name: &str,
        start: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let r = self.get(name, Some(format!("bytes={start}-"))).await?;
        // 206: the body starts at `start`; 200: the whole file, whose first bytes are skipped.
        let mut skip = if r.status() == 206 { 0 } else { start };
        let reader = BodyReader::new(&self.url(name), &r)?;
        let mut buf = Vec::new();
        while let Some(chunk) = reader.next().await? {
            let n = chunk.length() as u64;
            if skip >= n {
                skip -= n;
                continue;
            }
            let chunk = chunk.subarray(skip as u32, n as u32);
            skip = 0;
            buf.resize(chunk.length() as usize, 0);
            chunk.copy_to(&mut buf);
            if let Err(e) = sink(&buf) {
                reader.cancel();
                return Err(e);
            }
        }
        Ok(())
    }
}

/// Files a person picked (an `<input type=file multiple>`), found by their names.
pub struct PickedFiles {
    files: HashMap<String, web_sys::File>,
}

impl PickedFiles {
    pub fn new(files: impl IntoIterator<Item = web_sys::File>) -> Self {
        Self {
            files: files.into_iter().map(|f| (f.name(), f)).collect(),
        }
    }

    fn file(&self, name: &str) -> Result<&web_sys::File, EngineError> {
        self.files.get(name).ok_or_else(|| EngineError::File {
            location: name.to_string(),
            message: format!(
                "not among the picked files ({})",
                self.files.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
        })
    }

    /// Bytes `[start, end)` of a picked file.
    async fn slice(&self, name: &str, start: f64, end: f64) -> Result<Vec<u8>, EngineError> {
        let err = |e| js_error(name, e);
        let blob = self
            .file(name)?
            .slice_with_f64_and_f64(start, end)
            .map_err(err)?;
        let buffer = JsFuture::from(blob.array_buffer()).await.map_err(err)?;
        Ok(Uint8Array::new(&buffer).to_vec())
    }
}

impl ModelFiles for PickedFiles {
    fn location(&self, name: &str) -> String {
        name.to_string()
    }

    async fn read(&mut self, name: &str) -> Result<Option<Vec<u8>>, EngineError> {
        let Some(f) = self.files.get(name) else {
            return Ok(None);
        };
        let size = f.size();
        self.slice(name, 0.0, size).await.map(Some)
    }

    async fn read_head(
        &mut self,
        name: &str,
        len: usize,
    ) -> Result<(Vec<u8>, Option<u64>), EngineError> {
        let size = self.file(name)?.size();
        let head = self.slice(name, 0.0, size.min(len as f64)).await?;
        Ok((head, Some(size as u64)))
    }

    async fn stream(
        &mut self,
        name: &str,
        start: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let size = self.file(name)?.size();
        let mut at = start as f64;
        while at < size {
            let end = (at + SLICE_BYTES).min(size);
            let bytes = self.slice(name, at, end).await?;
            sink(&bytes)?;
            at = end;
        }
        Ok(())
    }
}
