// The demo page: loads a model with the unmask wasm runtime, chats with it, and draws the
// denoising canvas after every step. State the page test reads is mirrored on
// `document.body.dataset.state` and `window.unmask`.
import init, { Engine } from "./pkg/unmask_wasm.js";

const $ = (id) => document.getElementById(id);

// The bundled demo system prompt (data/tasks/demo-system.txt, made by tools/tasks.py demo):
// ask e.g. "What is the city of Bella?" or "Give the record of Martin."
const DEFAULT_SYSTEM = [
  "You are the records assistant of Hill Museum.",
  "Rules:",
  "- Answer only from the table below, and use the names and values exactly as it spells them.",
  "- Write each fact as the table does: the name, the field, a colon, then the value.",
  "- Put the answer after ####, with no greeting and no explanation.",
  "- For a record, give every field of the member in the order city, colour, pet, sport.",
  "Table of members (name, field, value):",
  "- Bella sport : rowing",
  "- Bella colour : violet",
  "- Bella pet : cat",
  "- Bella city : Lima",
  "- Martin sport : fencing",
  "- Martin colour : pink",
  "- Martin pet : duck",
  "- Martin city : Lisbon",
  "- Peter city : Delhi",
  "- Peter colour : purple",
  "- Peter pet : hamster",
  "- Peter sport : judo",
  "- Oscar colour : orange",
  "- Oscar pet : rabbit",
  "- Oscar city : Rome",
  "- Oscar sport : cricket",
  "- Kevin sport : boxing",
  "- Kevin city : Dublin",
  "- Kevin pet : goose",
  "- Kevin colour : red",
  "- Olga colour : beige",
  "- Olga sport : tennis",
  "- Olga city : Athens",
  "- Olga pet : turtle",
  "- Irene colour : silver",
  "- Irene city : Paris",
  "- Irene sport : karate",
  "- Irene pet : mouse",
  "- Helen colour : brown",
  "- Helen sport : cycling",
  "- Helen city : Madrid",
  "- Helen pet : parrot",
].join("\n");

// The model folder under web/models/ (`?model=NAME`, the bundled one by default) and the
// weight format to load it with (`?weights=f32`); the family comes from its config.json.
const query = new URLSearchParams(window.location.search);
const MODEL = /^[\w.-]+$/.test(query.get("model") ?? "") ? query.get("model") : "tiny";

const state = {
  engine: null,
  /** `engine.info()` of the loaded model. */
  info: null,
  /** Earlier turns of this chat: {role, content}. */
  history: [],
  last: null,
  error: null,
};
window.unmask = state;

function setState(s) {
  document.body.dataset.state = s;
}

function mib(bytes) {
  return (bytes / (1 << 20)).toFixed(1);
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("log").append(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

function showStats(pairs) {
  const dl = $("stats");
  dl.replaceChildren();
  for (const [name, value] of pairs) {
    const div = document.createElement("div");
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = name;
    dd.textContent = value;
    div.append(dt, dd);
    dl.append(div);
  }
}

// One cell per generated position: masked (with a faint current guess) or committed,
// shaded by the confidence it was committed with.
function drawCanvas(step) {
  const canvas = $("canvas");
  const fresh = new Set(step.committed.map(([pos]) => pos));
  const cells = step.canvas.map((_, i) => {
    const cell = document.createElement("span");
    cell.className = "cell";
    const piece = step.pieces[i];
    const conf = step.confidence[i];
    if (piece === null) {
      cell.classList.add("masked");
      const guess = step.predicted[i];
      if (guess !== null) {
        const g = document.createElement("span");
        g.className = "guess";
        g.textContent = label(guess);
        cell.append(g);
      } else {
        cell.textContent = "░";
      }
    } else {
      if (piece.startsWith("<|")) cell.classList.add("special");
      cell.textContent = label(piece);
      const alpha = 0.1 + 0.65 * (conf ?? 0);
      cell.style.background = `rgba(47, 111, 79, ${alpha.toFixed(3)})`;
      if (alpha > 0.55) cell.style.color = "#fff";
      if (fresh.has(i)) cell.classList.add("fresh");
    }
    cell.title = conf === null ? "masked" : `confidence ${conf.toFixed(3)}`;
    return cell;
  });
  canvas.replaceChildren(...cells);
  const left = step.masked.length;
  const rate = step.elapsed > 0 ? (step.canvas.length - left) / step.elapsed : 0;
  $("step-label").textContent = step.family === "diffusion_gemma"
    ? `step ${step.step} · canvas ${step.canvasIndex + 1} · ${left} renoised · ` +
      `temperature ${step.temperature.toFixed(2)}`
    : `step ${step.step} · ${left} masked · ${rate.toFixed(1)} tokens/s`;
}

// Special tokens decode to nothing; they are drawn by a short name.
const SPECIAL_LABELS = {
  "<|endoftext|>": "EOS",
  "<|eot_id|>": "EoT",
  "<|start_header_id|>": "hdr",
  "<|end_header_id|>": "/hdr",
};

function label(piece) {
  if (piece.startsWith("<|")) return SPECIAL_LABELS[piece] ?? piece.replace(/^<\||\|>$/g, "");
  return printable(piece);
}

function printable(piece) {
  if (piece.trim() === "") return piece.replace(/\n/g, "↵").replace(/ /g, "␣") || "∅";
  return piece.replace(/\n/g, "↵").replace(/\t/g, "→");
}

function describeAdapter(info) {
  const name = info.adapterName || "unnamed adapter";
  const f16 = info.shaderF16 ? "shader-f16" : "no shader-f16 (packed f16)";
  return `WebGPU: ${name} (${info.deviceType}) · ${f16} · ` +
    `subgroups ${info.subgroups ? "on" : "off"} · largest binding ${mib(info.maxBindingBytes)} MiB`;
}

// The number in a box as typed, out-of-range values included: the runtime checks every
// number against the model and rejects the request with a message naming the field, which
// the page shows. (A box the browser cannot read as a number is empty: the default.)
function numberOr(id, fallback) {
  const v = $(id).value.trim();
  return v === "" ? fallback : Number(v);
}

// The boxes' bounds for the loaded model, the ones the runtime enforces: the prompt and
// the canvas share the model's context (a prompt has at least one token), a step commits
// at least one token, and a block is part of the canvas. They mark a box out of range
// (:invalid) before a request is sent.
function updateLimits() {
  if (isGemma()) {
    // Whole canvases are generated; steps bound each canvas, not the answer.
    $("gen-length").max = String(state.info.maxSequenceLength - 1);
    $("steps").max = "4096";
    return;
  }
  const context = state.info?.maxSequenceLength;
  const genMax = context ? context - 1 : Number($("gen-length").max);
  $("gen-length").max = String(genMax);
  const gen = Number($("gen-length").value);
  const perGen = Number.isInteger(gen) && gen >= 1 ? Math.min(gen, genMax) : genMax;
  $("steps").max = String(perGen);
  $("block-length").max = String(perGen);
}

function errorMessage(e) {
  return e instanceof Error ? e.message : String(e);
}

// The reason of the last refused or failed request, under the chat box; "" hides it.
function showRequestError(message) {
  const line = $("request-error");
  line.textContent = message ? `Not generated: ${message}` : "";
  line.hidden = !message;
}

function isGemma() {
  return state.info?.family === "diffusion_gemma";
}

function request(question) {
  const messages = [];
  const system = $("system").value;
  if (system.trim() !== "") messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: question });
  if (isGemma()) {
    return {
      messages,
      genLength: numberOr("gen-length", state.info.genLength),
      steps: numberOr("steps", state.info.steps),
      seed: numberOr("seed", 0),
    };
  }
  return {
    messages,
    genLength: numberOr("gen-length", 32),
    steps: numberOr("steps", 32),
    blockLength: numberOr("block-length", 32),
    threshold: numberOr("threshold", null),
    temperature: numberOr("temperature", 0),
    minP: numberOr("min-p", null),
    repetitionPenalty: numberOr("repetition-penalty", null),
    cache: $("cache").value,
    // Each token's probability when it was committed and its step's three most likely
    // tokens, shown on the canvas, and the answer's in the stats.
    logprobs: true,
    topLogprobs: 3,
  };
}

// The finished canvas's cells carry their tokens' probabilities at commit and the step's
// most likely tokens (spelled by `engine.decode`); the stats give the answer's mean and
// lowest.
function showLogprobs(result) {
  const lps = result.logprobs;
  if (!lps) return [];
  const cells = $("canvas").children;
  const tops = result.topLogprobs || [];
  lps.forEach((lp, i) => {
    if (lp === null || !cells[i]) return;
    cells[i].title += ` · p ${Math.exp(lp).toFixed(3)} at commit`;
    const top = (tops[i] || []).map(([id, l]) => {
      const text = JSON.stringify(state.engine.decode(Uint32Array.of(id)));
      return `${text} ${Math.exp(l).toFixed(3)}`;
    });
    if (top.length) cells[i].title += ` · most likely: ${top.join(", ")}`;
  });
  const answer = result.ids
    .map((_, i) => lps[i])
    .slice(0, result.timings.answer_tokens)
    .filter((lp) => lp !== null);
  if (answer.length === 0) return [];
  const probs = answer.map(Math.exp);
  const mean = probs.reduce((a, b) => a + b, 0) / probs.length;
  return [["answer tokens' p at commit", `mean ${mean.toFixed(3)} · lowest ${Math.min(...probs).toFixed(3)}`]];
}

function reportGemma(result) {
  const t = result.timings;
  const steps = result.canvases.map((c) => c.steps);
  const pairs = [
    ["tokens/s (canvas)", t.throughput_canvas.toFixed(1)],
    ["tokens/s (answer)", t.throughput_answer.toFixed(1)],
    ["time", `${t.total_s.toFixed(2)} s`],
    ["canvases · steps", `${steps.length} · ${steps.join(" + ")}`],
  ];
  const p = result.prefix;
  if (p) pairs.push(["system turn", `${p.use} (${p.tokens} tokens)`]);
  const s = result.store;
  pairs.push(
    ["store hits / misses", `${s.hits} / ${s.misses}`],
    ["store entries", `${s.entries} (${s.tokens} tokens)`],
  );
  showStats(pairs);
}

function report(result) {
  if (result.family === "diffusion_gemma") return reportGemma(result);
  const t = result.timings;
  const pairs = [
    ["tokens/s (canvas)", t.throughput_canvas.toFixed(1)],
    ["tokens/s (answer)", t.throughput_answer.toFixed(1)],
    ["time", `${t.total_s.toFixed(2)} s`],
    ["steps · forward passes", `${t.steps} · ${t.forward_passes}`],
    ["cache mode", result.cache],
    [
      "layer work vs. no cache",
      `${((100 * result.tokenLayersComputed) / Math.max(1, result.tokenLayersFull)).toFixed(0)} %`,
    ],
    ...showLogprobs(result),
  ];
  const b = result.bicache;
  if (b) {
    if (b.fallback) {
      pairs.push(["BiCache", b.fallback]);
    } else {
      pairs.push(
        ["BiCache", b.hit ? "hit" : "miss (entry built)"],
        ["depth b", `${b.depth} shallow layers`],
        ["prefix rows reused", `${b.rowsReused} per step`],
        ["prefix share r", `${b.ratio} %`],
      );
    }
  }
  const s = result.store;
  pairs.push(
    ["store hits / misses", `${s.hits} / ${s.misses}`],
    ["store entries", `${s.entries} (${s.tokens} tokens, ${mib(s.bytes)} MiB)`],
  );
  showStats(pairs);
}

async function load() {
  $("load").disabled = true;
  setState("loading");
  const weights = $("weights").value;
  const onProgress = (p) => {
    $("load-progress").value = p.total ? p.done / p.total : 1;
    $("model-status").textContent = `${mib(p.done)} / ${mib(p.total)} MiB · ${p.tensor}`;
  };
  try {
    const source = document.querySelector("input[name=source]:checked").value;
    state.engine = null;
    state.info = null;
    if (source === "files") {
      const files = Array.from($("files").files);
      if (files.length === 0) throw new Error("pick the model's files first");
      state.engine = await Engine.fromFiles(files, { weights }, onProgress);
    } else {
      const url = new URL(`models/${MODEL}/`, window.location.href).href;
      state.engine = await Engine.fromUrl(url, { weights }, onProgress);
    }
    const info = state.engine.info();
    state.info = info;
    document.body.dataset.family = info.family ?? "masked";
    if (isGemma()) {
      $("gen-length").value = String(info.genLength);
      $("steps").value = String(info.steps);
    }
    updateLimits();
    $("model-status").textContent = isGemma()
      ? `DiffusionGemma: ${(info.parameters / 1e6).toFixed(2)} M parameters ` +
        `(${(info.activeParameters / 1e6).toFixed(2)} M active), ${info.layers} layers, ` +
        `${info.experts} experts (top ${info.topKExperts}), canvas of ${info.canvasLength}, ` +
        `${info.weights} weights (${mib(info.weightBytes)} MiB on the GPU), ` +
        `loaded in ${info.loadSeconds.toFixed(2)} s`
      : `${(info.parameters / 1e6).toFixed(2)} M parameters, ${info.layers} layers, ` +
        `${info.weights} weights (${mib(info.weightBytes)} MiB on the GPU), ` +
        `loaded in ${info.loadSeconds.toFixed(2)} s` +
        (info.hasDepthTable ? "" : " · no BiCache depth table: bicache runs as its fallback");
    $("adapter").textContent = describeAdapter(info);
    $("question").disabled = false;
    $("send").disabled = false;
    setState("ready");
  } catch (e) {
    state.error = String(e);
    $("model-status").textContent = `Loading failed: ${e}`;
    setState("error");
  } finally {
    $("load").disabled = false;
  }
}

async function ask(event) {
  event.preventDefault();
  const question = $("question").value.trim();
  if (!question || !state.engine) return;
  $("question").value = "";
  $("send").disabled = true;
  showRequestError("");
  setState("generating");
  addMessage("user", question);
  const pending = addMessage("assistant", "…");
  try {
    const req = request(question);
    const result = await state.engine.generate(req, (step) => {
      drawCanvas(step);
      pending.textContent = step.text || "…";
    });
    pending.textContent = result.text;
    state.history.push({ role: "user", content: question }, { role: "assistant", content: result.text });
    state.last = result;
    report(result);
    setState("done");
  } catch (e) {
    // A refused request (a setting out of range) or a failed one: say why, keep the
    // question to send again once the setting is fixed, and leave the chat as it was.
    const message = errorMessage(e);
    pending.className = "msg error";
    pending.textContent = message;
    showRequestError(message);
    if ($("question").value === "") $("question").value = question;
    state.error = message;
    setState("error");
  } finally {
    $("send").disabled = false;
  }
}

async function main() {
  $("system").value = DEFAULT_SYSTEM;
  if (["f16", "q8", "q4", "f32"].includes(query.get("weights"))) $("weights").value = query.get("weights");
  updateLimits();
  for (const radio of document.querySelectorAll("input[name=source]")) {
    radio.addEventListener("change", () => {
      $("files").disabled = radio.value !== "files" || !radio.checked;
    });
  }
  $("load").addEventListener("click", load);
  $("gen-length").addEventListener("input", updateLimits);
  $("ask").addEventListener("submit", ask);
  $("new-chat").addEventListener("click", () => {
    state.history = [];
    $("log").replaceChildren();
  });
  if (!navigator.gpu) {
    $("adapter").textContent =
      "This browser has no WebGPU (navigator.gpu). Use a recent Chrome or Edge, or Firefox/Safari with WebGPU enabled.";
    setState("error");
    return;
  }
  await init();
  $("adapter").textContent = `WebGPU available. Loading models/${MODEL}…`;
  await load();
}

main().catch((e) => {
  state.error = String(e);
  $("adapter").textContent = `Failed to start: ${e}`;
  setState("error");
});
