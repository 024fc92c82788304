//! The prefix store's changes published as vLLM's KV-cache events, for routers that route
//! by what each replica holds (`--kv-events ENDPOINT`): a ZMQ PUB socket sending multipart
//! messages [topic, sequence number (8 bytes, big-endian), payload], the payload a
//! msgpack `KVEventBatch` as vLLM encodes it (array-like: [timestamp, events, data-parallel
//! rank]), each event array-like and tagged by its first element:
//!
//! - `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`
//! - `["BlockRemoved", block_hashes, medium]`
//! - `["AllBlocksCleared"]`
//!
//! An entry's tokens are cut into blocks of `block_size` tokens (a partial last block is
//! not published: nothing can match it). Block hashes are chained, each over its parent's
//! hash and its tokens: the first 8 bytes (big-endian) of SHA-256 of the parent hash (8
//! bytes, big-endian; 0 for the first block) followed by the block's token ids (4 bytes each,
//! little-endian). Two entries that share leading blocks share their hashes; a block is
//! published as stored when the first entry holding it is stored and as removed when the
//! last one goes.

use std::collections::HashMap;

use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc::UnboundedReceiver;
use unmask_core::prefix_store::StoreEvent;
use zeromq::{Socket, SocketSend, ZmqMessage};

/// Where and how events are published.
#[derive(Clone, Debug)]
pub struct KvEventsConfig {
    /// A ZMQ endpoint to bind, e.g. `tcp://127.0.0.1:5557`.
    pub endpoint: String,
    pub topic: String,
    /// Tokens per hashed block.
    pub block_size: usize,
}

/// The chained hash of a block after `parent`.
pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = Sha256::new();
    h.update(parent.unwrap_or(0).to_be_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    let digest = h.finalize();
    u64::from_be_bytes(digest[..8].try_into().unwrap_or([0; 8]))
}

/// The full blocks of `tokens` with their chained hashes: (hash, parent, tokens).
pub fn blocks(tokens: &[u32], block_size: usize) -> Vec<(u64, Option<u64>, &[u32])> {
    let mut out = Vec::new();
    let mut parent = None;
    for block in tokens.chunks_exact(block_size.max(1)) {
        let hash = block_hash(parent, block);
        out.push((hash, parent, block));
        parent = Some(hash);
    }
    out
}

/// `BlockStored`'s fields: tag, block hashes, parent hash, token ids, block size, LoRA id,
/// storage medium.
type Stored<'a> = (
    &'static str,
    Vec<u64>,
    Option<u64>,
    Vec<u32>,
    usize,
    Option<u32>,
    Option<&'a str>,
);

/// One encoded event (array-like, tagged by its first element).
#[derive(Serialize)]
#[serde(untagged)]
enum Event<'a> {
    Stored(Stored<'a>),
    Removed((&'static str, Vec<u64>, Option<&'a str>)),
    Cleared((&'static str,)),
}

/// Turns store changes into event batches, keeping how many entries hold each block.
#[derive(Default)]
pub struct Encoder {
    block_size: usize,
    holders: HashMap<u64, usize>,
}

impl Encoder {
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            holders: HashMap::new(),
        }
    }

    /// The msgpack `KVEventBatch` of `changes` at `timestamp` (seconds), or `None` when
    /// they change no published block.
    pub fn batch(&mut self, changes: &[StoreEvent], timestamp: f64) -> Option<Vec<u8>> {
        let mut events = Vec::new();
        for change in changes {
            match change {
                StoreEvent::Stored(tokens) => {
                    let mut hashes = Vec::new();
                    let mut ids = Vec::new();
                    let mut first_parent = None;
                    for (hash, parent, block) in blocks(tokens, self.block_size) {
                        let n = self.holders.entry(hash).or_insert(0);
                        *n += 1;
                        if *n == 1 {
                            if hashes.is_empty() {
                                first_parent = parent;
                            }
                            hashes.push(hash);
                            ids.extend_from_slice(block);
                        }
                    }
                    if !hashes.is_empty() {
                        events.push(Event::Stored((
                            "BlockStored",
                            hashes,
                            first_parent,
                            ids,
                            self.block_size,
                            None,
                            None,
                        )));
                    }
                }
                StoreEvent::Removed(tokens) => {
                    let mut gone = Vec::new();
                    for (hash, _, _) in blocks(tokens, self.block_size) {
                        if let Some(n) = self.holders.get_mut(&hash) {
                            *n -= 1;
                            if *n == 0 {
                                self.holders.remove(&hash);
                                gone.push(hash);
                            }
                        }
                    }
                    if !gone.is_empty() {
                        events.push(Event::Removed(("BlockRemoved", gone, None)));
                    }
                }
                StoreEvent::Cleared => {
                    self.holders.clear();
                    events.push(Event::Cleared(("AllBlocksCleared",)));
                }
            }
        }
        if events.is_empty() {
            return None;
        }
        rmp_serde::to_vec(&(timestamp, events, None::<u32>)).ok()
    }
}

/// Binds the PUB socket (before the server announces its address) and returns the task
/// that publishes every batch of store changes received, numbered from 0.
pub async fn publisher(
    config: KvEventsConfig,
    mut changes: UnboundedReceiver<Vec<StoreEvent>>,
) -> Result<impl std::future::Future<Output = ()>, String> {
    let mut socket = zeromq::PubSocket::new();
    socket
        .bind(&config.endpoint)
        .await
        .map_err(|e| format!("cannot bind the KV-event socket {}: {e}", config.endpoint))?;
    Ok(async move {
        let mut encoder = Encoder::new(config.block_size);
        let mut seq: u64 = 0;
        while let Some(batch) = changes.recv().await {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let Some(payload) = encoder.batch(&batch, now) else {
                continue;
            };
            let mut message = ZmqMessage::from(config.topic.clone());
            message.push_back(bytes::Bytes::copy_from_slice(&seq.to_be_bytes()));
            message.push_back(bytes::Bytes::from(payload));
            // A subscriber that is not there misses the batch, as with vLLM's publisher.
            let _ = socket.send(message).await;
            seq += 1;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_blocks_are_stored_once_and_removed_with_their_last_holder() {
        let mut enc = Encoder::new(2);
        let a = vec![1, 2, 3, 4, 5];
        let b = vec![1, 2, 3, 4, 9, 9];
        let first = enc.batch(&[StoreEvent::Stored(a.clone())], 1.0).unwrap();
        let v: rmpv::Value = rmp_serde::from_slice(&first).unwrap();
        let event = &v[1][0];
        assert_eq!(event[0].as_str(), Some("BlockStored"));
        // Two full blocks of 2 (the fifth token is a partial block).
        assert_eq!(event[1].as_array().unwrap().len(), 2);
        assert!(event[2].is_nil(), "the first block has no parent");
        assert_eq!(event[3].as_array().unwrap().len(), 4);
        assert_eq!(event[4].as_u64(), Some(2));
        // b shares a's two blocks: only its third is new, chained to a's second.
        let second = enc.batch(&[StoreEvent::Stored(b.clone())], 2.0).unwrap();
        let v: rmpv::Value = rmp_serde::from_slice(&second).unwrap();
        let event = &v[1][0];
        assert_eq!(event[1].as_array().unwrap().len(), 1);
        let parent = blocks(&a, 2)[1].0;
        assert_eq!(event[2].as_u64(), Some(parent));
        // a goes: its blocks are still b's, nothing is removed; b goes: all three.
        assert!(enc.batch(&[StoreEvent::Removed(a)], 3.0).is_none());
        let gone = enc.batch(&[StoreEvent::Removed(b)], 4.0).unwrap();
        let v: rmpv::Value = rmp_serde::from_slice(&gone).unwrap();
        assert_eq!(v[1][0][0].as_str(), Some("BlockRemoved"));
        assert_eq!(v[1][0][1].as_array().unwrap().len(), 3);
        let cleared = enc.batch(&[StoreEvent::Cleared], 5.0).unwrap();
        let v: rmpv::Value = rmp_serde::from_slice(&cleared).unwrap();
        assert_eq!(v[1][0][0].as_str(), Some("AllBlocksCleared"));
        assert_eq!(v[0].as_f64(), Some(5.0));
    }
}
