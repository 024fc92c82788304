//! A safetensors file's data section arriving in pieces (a download, a file read in slices)
//! cut into whole rows of each tensor for a `WeightUpload`. At most one block of rows is
//! held in host memory; a piece that already holds whole blocks is passed on without a copy.

use std::ops::Range;
use std::path::PathBuf;

use super::ModelError;
use super::checkpoint::{CheckpointError, FileHeader};
use super::weights::WeightUpload;

/// Bytes of rows collected before they are uploaded, when pieces are smaller than this.
const BLOCK_BYTES: usize = 8 << 20;

/// The data section of one file, consumed in order.
pub struct BodyStream {
    path: PathBuf,
    /// (tensor name, byte range in the data section), in file order.
    tensors: Vec<(String, Range<usize>)>,
    data_len: usize,
    /// Bytes of the data section consumed so far (including `carry`).
    pos: usize,
    /// Index into `tensors` of the tensor at `pos`.
    current: usize,
    /// Bytes of the current tensor not uploaded yet; always starts at a row boundary.
    carry: Vec<u8>,
}

impl BodyStream {
    pub fn new(header: &FileHeader) -> Self {
        Self {
            path: header.path.clone(),
            tensors: header
                .tensors_in_order()
                .into_iter()
                .map(|(n, r)| (n.to_string(), r))
                .collect(),
            data_len: header.data_len() as usize,
            pos: 0,
            current: 0,
            carry: Vec::new(),
        }
    }

    /// Bytes of the data section consumed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Consumes the next bytes of the data section.
    pub fn push(
        &mut self,
        upload: &mut WeightUpload<'_>,
        mut piece: &[u8],
    ) -> Result<(), ModelError> {
        while !piece.is_empty() {
            while self
                .tensors
                .get(self.current)
                .is_some_and(|(_, r)| r.end <= self.pos)
            {
                self.current += 1;
            }
            let Some((name, range)) = self.tensors.get(self.current) else {
                // Past the last tensor: nothing more to upload.
                self.pos += piece.len();
                return Ok(());
            };
            let left = range.end - self.pos;
            let take = piece.len().min(left);
            let Some(row_bytes) = upload.row_bytes(name).filter(|&b| b > 0) else {
                // A tensor the model does not use.
                self.pos += take;
                piece = &piece[take..];
                continue;
            };
            let block = (BLOCK_BYTES / row_bytes).max(1) * row_bytes;
            if self.carry.is_empty() {
                let whole = take / row_bytes * row_bytes;
                if whole > 0 && (whole >= block || whole == left) {
                    let row = (self.pos - range.start) / row_bytes;
                    upload.rows(name, row, &piece[..whole])?;
                    self.pos += whole;
                    piece = &piece[whole..];
                    continue;
                }
            }
            let room = (block - self.carry.len().min(block)).max(row_bytes);
            let n = take.min(room);
            self.carry.extend_from_slice(&piece[..n]);
            self.pos += n;
            piece = &piece[n..];
            if self.carry.len() >= block || self.pos == range.end {
                let whole = self.carry.len() / row_bytes * row_bytes;
                let carry_start = self.pos - self.carry.len();
                let row = (carry_start - range.start) / row_bytes;
                upload.rows(name, row, &self.carry[..whole])?;
                self.carry.drain(..whole);
                if self.pos == range.end && !self.carry.is_empty() {
                    return Err(CheckpointError::Corrupt {
                        path: self.path.clone(),
                        message: format!("tensor {name} is not a whole number of rows"),
                    }
                    .into());
                }
            }
        }
        Ok(())
    }

    /// Checks that the whole data section arrived.
    pub fn finish(self) -> Result<(), ModelError> {
        if self.pos < self.data_len {
            return Err(CheckpointError::Corrupt {
                path: self.path,
                message: format!(
                    "the stream ended after {} of {} bytes of data (truncated?)",
                    self.pos, self.data_len
                ),
            }
            .into());
        }
        Ok(())
    }
}
