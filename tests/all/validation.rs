//! The Khronos Vulkan validation layers catch what lavapipe forgives. Each test records one
//! mistake as raw Vulkan commands through wgpu's HAL escape hatch (wgpu never sees them, so
//! it inserts no barrier and adds no usage flag for them) and passes only if the layers
//! report it. scripts/test-validation.sh runs them under the layers with synchronization
//! validation to show that its check of the suite fails on such a report; elsewhere they
//! are ignored, since without the layers (`apt-get install vulkan-validationlayers`) nothing
//! reports the mistake.

use std::sync::Mutex;

use ash::vk;
use wgpu::hal::api::Vulkan;

/// What wgpu-hal logged at error level: its debug messenger forwards each message of the
/// layers to the `log` crate, naming the message ID (a VUID or a SYNC-HAZARD-* name).
struct ErrorRecorder(Mutex<Vec<String>>);

impl log::Log for ErrorRecorder {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() == log::Level::Error && metadata.target().starts_with("wgpu_hal")
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            let text = record.args().to_string();
            self.0.lock().unwrap_or_else(|e| e.into_inner()).push(text);
        }
    }

    fn flush(&self) {}
}

static RECORDER: ErrorRecorder = ErrorRecorder(Mutex::new(Vec::new()));

/// The errors recorded so far that name `id`.
fn reported(id: &str) -> Vec<String> {
    let all = RECORDER.0.lock().unwrap_or_else(|e| e.into_inner());
    all.iter().filter(|m| m.contains(id)).cloned().collect()
}

/// A device of its own (the suite's shared context stays clean) on an instance that asks
/// for the validation layers (wgpu turns on synchronization validation with them) and, with
/// `DEBUG`, registers the debug messenger that logs their messages.
fn vulkan_device() -> (wgpu::Device, wgpu::Queue) {
    // Another test of this module may have installed it already.
    let _ = log::set_logger(&RECORDER);
    log::set_max_level(log::LevelFilter::Error);
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::VULKAN;
    desc.flags = wgpu::InstanceFlags::VALIDATION | wgpu::InstanceFlags::DEBUG;
    let instance = wgpu::Instance::new(desc);
    let adapter = pollster::block_on(instance.request_adapter(&Default::default()))
        .expect("a Vulkan adapter (lavapipe without a GPU)");
    pollster::block_on(adapter.request_device(&Default::default())).expect("a Vulkan device")
}

fn buffer(device: &wgpu::Device, label: &str, usage: wgpu::BufferUsages) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: 256,
        usage,
        mapped_at_creation: false,
    })
}

/// The Vulkan handle of `buffer`.
fn raw_buffer(buffer: &wgpu::Buffer) -> vk::Buffer {
    // SAFETY: the handle is only recorded into a command buffer that is submitted and
    // waited for while `buffer` is alive; it is never destroyed here.
    unsafe {
        buffer
            .as_hal::<Vulkan>()
            .expect("a Vulkan buffer")
            .raw_handle()
    }
}

/// Records `commands` into a command buffer of `device`, submits it and waits for it.
fn record_and_submit(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    commands: impl FnOnce(&ash::Device, vk::CommandBuffer),
) {
    // SAFETY: the ash device outlives the recording (a clone of wgpu's function table and
    // handle); the command buffer is wgpu's open one, neither ended nor freed here.
    let raw_device = unsafe { device.as_hal::<Vulkan>() }
        .expect("a Vulkan device")
        .raw_device()
        .clone();
    let mut encoder = device.create_command_encoder(&Default::default());
    unsafe {
        encoder.as_hal_mut::<Vulkan, _, _>(|hal| {
            let command_buffer = hal.expect("a Vulkan command encoder").raw_handle();
            commands(&raw_device, command_buffer);
        });
    }
    queue.submit([encoder.finish()]);
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("the submission completes");
}

fn assert_reported(id: &str) {
    let messages = reported(id);
    assert!(
        !messages.is_empty(),
        "the validation layers did not report {id} (are they installed? \
         apt-get install vulkan-validationlayers)"
    );
    eprintln!(
        "[validation] reported as expected:\n{}",
        messages.join("\n")
    );
}

/// Two fills of one buffer with no barrier between them: a write-after-write hazard that
/// only synchronization validation sees (lavapipe runs commands in order).
#[test]
#[ignore = "needs the Vulkan validation layers; scripts/test-validation.sh runs it"]
fn a_missing_barrier_is_reported() {
    let (device, queue) = vulkan_device();
    let target = buffer(&device, "written twice", wgpu::BufferUsages::STORAGE);
    let raw = raw_buffer(&target);
    record_and_submit(&device, &queue, |vk_device, command_buffer| unsafe {
        vk_device.cmd_fill_buffer(command_buffer, raw, 0, 256, 1);
        vk_device.cmd_fill_buffer(command_buffer, raw, 0, 256, 2);
    });
    assert_reported("SYNC-HAZARD-WRITE-AFTER-WRITE");
}

/// A copy out of a buffer created without `COPY_SRC` (Vulkan's TRANSFER_SRC usage).
#[test]
#[ignore = "needs the Vulkan validation layers; scripts/test-validation.sh runs it"]
fn a_missing_usage_flag_is_reported() {
    let (device, queue) = vulkan_device();
    let source = buffer(&device, "no COPY_SRC", wgpu::BufferUsages::STORAGE);
    let target = buffer(
        &device,
        "copy target",
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
    );
    let (src, dst) = (raw_buffer(&source), raw_buffer(&target));
    let region = vk::BufferCopy {
        src_offset: 0,
        dst_offset: 0,
        size: 256,
    };
    record_and_submit(&device, &queue, |vk_device, command_buffer| unsafe {
        vk_device.cmd_copy_buffer(command_buffer, src, dst, &[region]);
    });
    assert_reported("VUID-vkCmdCopyBuffer-srcBuffer-00118");
}
