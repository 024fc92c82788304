//! Writing a quantized copy of a checkpoint (`unmask quantize`): the matrices as codes and
//! scales in the byte layout the GPU uses (`unmask_core::quant`), so loading it uploads
//! them without conversion; norm weights and matrices left unquantized are copied as
//! stored. Needs no GPU.
//!
//! A matrix `<prefix>.weight` becomes `<prefix>.qweight` (q8: I8 `[rows, P]` codes; q4: U8
//! `[rows, P / 2]`, two codes per byte) and `<prefix>.scales` (F16 `[rows, P / 32]`), where
//! `P` is the row length padded to `unmask_core::quant::ROW_ALIGN`. `__metadata__` names the
//! block size, the row padding and the formats (see the `META_*` keys in `checkpoint`).

use std::collections::BTreeMap;
use std::io::Write;

use unmask_core::config::ModelConfig;
use unmask_core::quant::{self, QuantFormat};
use unmask_core::safetensors_writer::{Dtype, SafetensorsWriter, TensorDecl};

use super::ModelError;
use super::checkpoint::{
    Checkpoint, CheckpointError, META_BLOCK, META_EMBED, META_LAYERS, META_ROW_ALIGN,
    QWEIGHT_SUFFIX, SCALES_SUFFIX, StoredDType,
};
use super::weights::{BLOCK_VALUES, LoadProgress, Source, index_row, matrix_source};

/// What one tensor of the output is made from.
enum Plan<'a> {
    /// Quantize (or copy codes already in this format) a `[rows, cols]` matrix.
    Quantize {
        name: String,
        src: Source<'a>,
        format: QuantFormat,
        rows: usize,
        cols: usize,
    },
    /// Copy a tensor's bytes as stored (float, or codes and scales of a quantized source).
    Copy {
        name: String,
        parts: Vec<&'a [u8]>,
        stored: usize,
    },
}

fn dtype_of(d: StoredDType) -> Dtype {
    match d {
        StoredDType::BF16 => Dtype::BF16,
        StoredDType::F16 => Dtype::F16,
        StoredDType::F32 => Dtype::F32,
    }
}

fn code_dtype(format: QuantFormat) -> Dtype {
    match format {
        QuantFormat::Q8 => Dtype::I8,
        QuantFormat::Q4 => Dtype::U8,
    }
}

/// Declarations of a quantized matrix's two tensors.
fn quant_decls(name: &str, format: QuantFormat, rows: usize, cols: usize) -> [TensorDecl; 2] {
    let prefix = name.strip_suffix(".weight").unwrap_or(name);
    [
        TensorDecl::new(
            format!("{prefix}{QWEIGHT_SUFFIX}"),
            code_dtype(format),
            vec![rows, format.row_code_bytes(cols)],
        ),
        TensorDecl::new(
            format!("{prefix}{SCALES_SUFFIX}"),
            Dtype::F16,
            vec![rows, quant::row_blocks(cols)],
        ),
    ]
}

fn format_name(f: Option<QuantFormat>) -> &'static str {
    f.map_or("none", QuantFormat::name)
}

/// Writes every tensor `cfg` names to `out` as one safetensors file: the blocks' matrices
/// in `layers`, the embedding table and LM head in `embed` (`None` keeps them as stored).
/// Returns the bytes written.
pub fn write_quantized(
    cfg: &ModelConfig,
    ckpt: &Checkpoint,
    layers: Option<QuantFormat>,
    embed: Option<QuantFormat>,
    out: impl Write,
    progress: &mut dyn FnMut(LoadProgress<'_>),
) -> Result<u64, ModelError> {
    let mut plans = Vec::new();
    let mut decls = Vec::new();
    let mut total = 0u64;
    // The format each group of matrices is stored in, for the metadata: [blocks, tables].
    let mut stored: [Option<Option<QuantFormat>>; 2] = [None, None];
    for (name, shape) in cfg.tensor_specs() {
        // The embedding table and the untied LM head take the embed format.
        let is_table = name == cfg.family.embedding_name() || name == cfg.family.lm_head_name();
        let target = if is_table { embed } else { layers };
        let (plan, format) = match (shape.as_slice(), target) {
            (&[rows, cols], Some(format)) => {
                let src = matrix_source(ckpt, &name, rows, cols)?;
                decls.extend(quant_decls(&name, format, rows, cols));
                let plan = Plan::Quantize {
                    name,
                    src,
                    format,
                    rows,
                    cols,
                };
                (plan, Some(Some(format)))
            }
            (&[rows, cols], None) => match matrix_source(ckpt, &name, rows, cols)? {
                Source::Float(t) => {
                    decls.push(TensorDecl::new(&name, dtype_of(t.dtype), shape.clone()));
                    let plan = Plan::Copy {
                        stored: t.data.len(),
                        parts: vec![t.data],
                        name,
                    };
                    (plan, Some(None))
                }
                Source::Quant(q) => {
                    decls.extend(quant_decls(&name, q.format, rows, cols));
                    let plan = Plan::Copy {
                        stored: q.stored_bytes(),
                        parts: vec![q.codes, q.scales],
                        name,
                    };
                    (plan, Some(Some(q.format)))
                }
            },
            _ => {
                let t = ckpt.tensor(&name, &shape)?;
                decls.push(TensorDecl::new(&name, dtype_of(t.dtype), shape.clone()));
                let plan = Plan::Copy {
                    stored: t.data.len(),
                    parts: vec![t.data],
                    name,
                };
                (plan, None)
            }
        };
        if let Some(format) = format {
            stored[usize::from(is_table)].get_or_insert(format);
        }
        total += match &plan {
            Plan::Quantize { src, .. } => src.stored_bytes() as u64,
            Plan::Copy { stored, .. } => *stored as u64,
        };
        plans.push(plan);
    }
    let [layers_stored, embed_stored] = stored.map(Option::flatten);
    let metadata = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        (META_BLOCK.to_string(), quant::BLOCK.to_string()),
        (META_ROW_ALIGN.to_string(), quant::ROW_ALIGN.to_string()),
        (
            META_LAYERS.to_string(),
            format_name(layers_stored).to_string(),
        ),
        (
            META_EMBED.to_string(),
            format_name(embed_stored).to_string(),
        ),
    ]);
    let mut writer = SafetensorsWriter::new(out, &metadata, decls)?;
    let file_len = writer.file_len();
    let mut done = 0u64;
    for plan in &plans {
        let name = match plan {
            Plan::Quantize {
                name,
                src,
                format,
                rows,
                cols,
            } => {
                write_matrix(&mut writer, name, src, *format, *rows, *cols)?;
                done += src.stored_bytes() as u64;
                name
            }
            Plan::Copy {
                name,
                parts,
                stored,
            } => {
                for part in parts {
                    writer.write(part)?;
                }
                done += *stored as u64;
                name
            }
        };
        progress(LoadProgress {
            tensor: name,
            done_bytes: done,
            total_bytes: total,
        });
    }
    writer.finish()?;
    Ok(file_len)
}

/// Writes the codes, then the scales, of one matrix, quantizing it in row blocks.
fn write_matrix<W: Write>(
    writer: &mut SafetensorsWriter<W>,
    name: &str,
    src: &Source<'_>,
    format: QuantFormat,
    rows: usize,
    cols: usize,
) -> Result<(), ModelError> {
    if let Source::Quant(q) = src
        && q.format == format
    {
        writer.write(q.codes)?;
        writer.write(q.scales)?;
        return Ok(());
    }
    let rows_per_block = (BLOCK_VALUES / cols.max(1)).max(1);
    let mut values = vec![0f32; rows_per_block.min(rows) * cols];
    let mut codes = Vec::new();
    // A matrix's scales are 1/16 (q8) or 1/8 (q4) of its codes: kept until the codes are out.
    let mut scales = vec![0u8; rows * quant::row_scale_bytes(cols)];
    let scale_row = quant::row_scale_bytes(cols);
    let mut row = 0;
    while row < rows {
        let n = rows_per_block.min(rows - row);
        let block = &mut values[..n * cols];
        src.read_f32(row, cols, block);
        codes.resize(n * format.row_code_bytes(cols), 0);
        format
            .quantize_rows(
                block,
                cols,
                &mut codes,
                &mut scales[row * scale_row..(row + n) * scale_row],
            )
            .map_err(|e| CheckpointError::Quantized {
                name: name.to_string(),
                path: src.path().to_path_buf(),
                message: format!(
                    "cannot quantize to {} (row {}): {e}",
                    format.name(),
                    row + index_row(&e, cols)
                ),
            })?;
        writer.write(&codes)?;
        row += n;
    }
    writer.write(&scales)?;
    Ok(())
}
