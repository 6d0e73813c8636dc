// The try-it page: pictures + a question → POST v1/chat (multipart) → the JSON-lines answer,
// rendered as it streams. Relative URLs only, so it works wherever the page is served (Nginx too).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "qwen3vl.apiKey";

const state = {
  conversationId: null, // set by the server's first line; sent back on follow-ups
  maxPixels: null,      // the server's per-image pixel budget (from v1/models)
  pending: [],          // pictures chosen for the next question
  controller: null,     // AbortController of the answer being streamed
  pictures: null,       // the latest turn's pictures ({strip, frames}): what an answer's boxes refer to
};

// ---- small helpers ---------------------------------------------------------------------------

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(0)} kB`;
  return `${(n / 1024 / 1024).toFixed(1)} MB`;
}

function seconds(s) {
  return s === undefined ? "–" : s < 0.1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`;
}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function setStatus(text) {
  $("status").textContent = text;
}

// A server error object → one readable sentence, naming the picture when the error is about one.
function describeError(error, images, status) {
  let message = error.message || "unknown error";
  const which = /^images?\[(\d+)\]/.exec(error.param || "");
  if (which && images[Number(which[1])]) message = `“${images[Number(which[1])].name}”: ${message}`;
  else if (error.param && !message.includes(error.param)) message += ` (field: ${error.param})`;
  const detail = [status ? `HTTP ${status}` : "", error.code || error.type || ""].filter(Boolean).join(" · ");
  return { message, detail };
}

async function responseError(response, images) {
  const body = await response.text();
  try {
    const { error } = JSON.parse(body);
    if (error) return describeError(error, images, response.status);
  } catch (_) { /* not JSON: a proxy's HTML page, say */ }
  const text = body.replace(/<[^>]*>/g, " ").replace(/\s+/g, " ").trim().slice(0, 200);
  return { message: text || response.statusText || "the server refused the request", detail: `HTTP ${response.status}` };
}

// ---- model info and the random-model banner ------------------------------------------------

function showRandomBanner(warning) {
  const banner = $("random-banner");
  banner.textContent = "⚠ " + (warning || "This is a random-weight test model: its answers are noise.");
  banner.hidden = false;
}

async function loadModelInfo() {
  let response;
  try {
    response = await fetch("v1/models", { headers: authHeaders() });
  } catch (err) {
    $("model-info").textContent = `Cannot reach the server (${err.message}); retrying…`;
    setTimeout(loadModelInfo, 3000);
    return;
  }
  if (response.status === 503) {
    $("model-info").textContent = "The model is loading…";
    setTimeout(loadModelInfo, 2000);
    return;
  }
  if (response.status === 401) {
    $("model-info").textContent = "This server needs an API key: enter it under Options.";
    $("options").open = true;
    return;
  }
  if (!response.ok) {
    $("model-info").textContent = (await responseError(response, [])).message;
    return;
  }
  const card = (await response.json()).data[0];
  $("model-info").textContent = `Model: ${card.id}` + (card.quantization ? ` (${card.quantization})` : "");
  if (card.random_test_model) showRandomBanner(card.warning);
  if (card.image_max_pixels) {
    state.maxPixels = card.image_max_pixels;
    const side = Math.round(Math.sqrt(card.image_max_pixels));
    $("budget").textContent = `Larger pictures are scaled down here to the server's budget (≈${side}×${side}).`;
  }
}

// ---- pictures: previews and the client-side downscale ---------------------------------------

// Scale a picture down into the server's pixel budget before upload (the server would resize it
// anyway; this saves the upload). A file the browser cannot read is sent as is: the server says why.
async function prepare(item) {
  let bitmap;
  try {
    bitmap = await createImageBitmap(item.file); // applies the EXIF orientation, as the server does
  } catch (_) {
    item.note = "The browser cannot read this as a picture; it is sent as is.";
    return;
  }
  item.width = bitmap.width;
  item.height = bitmap.height;
  const scale = state.maxPixels ? Math.sqrt(state.maxPixels / (bitmap.width * bitmap.height)) : 1;
  if (scale < 1) {
    const width = Math.max(1, Math.floor(bitmap.width * scale));
    const height = Math.max(1, Math.floor(bitmap.height * scale));
    const canvas = element("canvas");
    canvas.width = width;
    canvas.height = height;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff"; // transparency on white, as the server composites it
    ctx.fillRect(0, 0, width, height);
    ctx.imageSmoothingQuality = "high";
    ctx.drawImage(bitmap, 0, 0, width, height);
    const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/jpeg", 0.92));
    if (blob) {
      item.blob = blob;
      item.sentWidth = width;
      item.sentHeight = height;
      item.name = item.file.name.replace(/\.[^.]*$/, "") + ".jpg";
    }
  }
  bitmap.close();
}

function addFiles(files) {
  for (const file of files) {
    const item = { file, blob: file, name: file.name, url: URL.createObjectURL(file) };
    item.ready = prepare(item).then(renderPreviews);
    state.pending.push(item);
  }
  renderPreviews();
}

function describeItem(item) {
  const parts = [];
  if (item.width) parts.push(`${item.width}×${item.height}`);
  parts.push(formatBytes(item.file.size));
  let text = parts.join(" · ");
  if (item.sentWidth) text += ` → sent as ${item.sentWidth}×${item.sentHeight}, ${formatBytes(item.blob.size)}`;
  return text;
}

function renderPreviews() {
  const list = $("previews");
  list.replaceChildren();
  state.pending.forEach((item, index) => {
    const li = element("li", "preview");
    if (item.width) {
      const img = element("img");
      img.src = item.url;
      img.alt = `Preview of ${item.file.name}`;
      li.append(img);
    } else {
      li.append(element("span", "no-preview", item.note ? "no preview" : "…"));
    }
    const facts = element("div", "facts");
    facts.append(element("div", "name", item.file.name), element("div", "size", describeItem(item)));
    if (item.note) facts.append(element("div", "note", item.note));
    const remove = element("button", "", "Remove");
    remove.type = "button";
    remove.setAttribute("aria-label", `Remove ${item.file.name}`);
    remove.addEventListener("click", () => {
      URL.revokeObjectURL(item.url);
      state.pending.splice(index, 1);
      renderPreviews();
    });
    li.append(facts, remove);
    list.append(li);
  });
}

// ---- the conversation ----------------------------------------------------------------------

function addTurn(question, images) {
  const article = element("article", "turn");
  article.append(element("p", "question", question));
  if (images.length) {
    const strip = element("div", "turn-images");
    const frames = [];
    for (const item of images) {
      if (!item.width) continue;
      const frame = element("div", "picture");
      const img = element("img");
      img.src = item.url;
      img.alt = item.file.name;
      frame.append(img);
      strip.append(frame);
      frames.push(frame);
    }
    article.append(strip);
    if (frames.length) state.pictures = { strip, frames }; // what the answers' boxes refer to from now on
  }
  const answer = element("p", "answer");
  answer.setAttribute("aria-busy", "true");
  article.append(answer);
  $("transcript").append(article);
  article.scrollIntoView({ block: "end" });
  return { article, answer, images, text: "", finished: false };
}

function appendDelta(turn, delta) {
  turn.text += delta;
  turn.answer.textContent = turn.text;
}

// A thinking model's reasoning: folded above the answer (open it to read along).
function appendReasoning(turn, text) {
  if (!turn.reasoning) {
    const details = element("details", "reasoning");
    const summary = element("summary", "", "Thinking…");
    const body = element("p", "reasoning-text");
    details.append(summary, body);
    turn.article.insertBefore(details, turn.answer);
    turn.reasoning = { details, summary, body, text: "" };
  }
  turn.reasoning.text += text;
  turn.reasoning.body.textContent = turn.reasoning.text;
}

function endTurn(turn) {
  turn.finished = true;
  turn.answer.setAttribute("aria-busy", "false");
}

function showFailure(turn, { message, detail }) {
  endTurn(turn);
  const box = element("p", "error", message);
  box.setAttribute("role", "alert");
  if (detail) box.append(element("span", "detail", detail));
  turn.article.append(box);
}

// Boxes and points of a grounded answer over the pictures they refer to (the latest turn with
// pictures), in percent of each picture: the 0-1000 coordinates (clipped, corners in order) divided
// by 10, whatever its size.
const per1000 = (c) => Math.min(Math.max(c, 0), 1000) / 10;

const BOX_COLOURS = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#008080"];

function drawBoxes(boxes) {
  const pictures = state.pictures;
  if (!pictures || !boxes || !boxes.length) return;
  pictures.strip.classList.add("grounded");
  boxes.forEach((box, i) => {
    const frame = pictures.frames[box.image];
    if (!frame) return;
    const mark = element("div", box.bbox_2d ? "box" : "point");
    mark.style.setProperty("--box", BOX_COLOURS[i % BOX_COLOURS.length]);
    if (box.bbox_2d) {
      const [ax, ay, bx, by] = box.bbox_2d.map(per1000);
      const [x1, x2, y1, y2] = [Math.min(ax, bx), Math.max(ax, bx), Math.min(ay, by), Math.max(ay, by)];
      Object.assign(mark.style, { left: `${x1}%`, top: `${y1}%`, width: `${x2 - x1}%`, height: `${y2 - y1}%` });
      if (box.label) mark.append(element("span", "", box.label));
    } else {
      const [x, y] = box.point_2d.map(per1000);
      Object.assign(mark.style, { left: `${x}%`, top: `${y}%` });
    }
    mark.title = box.label || "";
    frame.append(mark);
  });
}

function showDone(turn, done) {
  endTurn(turn);
  drawBoxes(done.boxes);
  const u = done.usage || {};
  if (turn.reasoning) turn.reasoning.summary.textContent = `Reasoning (${u.reasoning_tokens} tokens)`;
  const t = done.timings || {};
  const images = done.images ? ` · ${done.images} picture${done.images === 1 ? "" : "s"} in the prompt` +
    (done.vision_cache_hits ? ` (${done.vision_cache_hits} from the vision cache)` : "") : "";
  turn.article.append(element("p", "usage",
    `${u.completion_tokens} tokens, finish: ${done.finish_reason} · prompt ${u.prompt_tokens} tokens, ` +
    `${u.cached_tokens} from cache${images}`));
  const timings = element("ul", "timings");
  timings.setAttribute("aria-label", "Timings");
  const rows = [
    ["queue", seconds(t.queue_wait)], ["image decode", seconds(t.image_decode)],
    ["vision encode", seconds(t.vision_encode)], ["prefill", seconds(t.prefill)],
    ["first token", seconds(t.time_to_first_token)], ["decode", seconds(t.decode)],
    ["speed", t.decode_tokens_per_s === undefined ? "–" : `${t.decode_tokens_per_s.toFixed(1)} tok/s`],
    ["total", seconds(t.total)],
  ];
  for (const [name, value] of rows) timings.append(element("li", "", `${name} ${value}`));
  turn.article.append(timings);
}

function showStopped(turn) {
  endTurn(turn);
  turn.article.append(element("p", "note",
    "Stopped. The server ended this generation; this turn is not part of the remembered conversation."));
}

// One JSON object per line; a line may arrive split across reads.
async function readLines(body, onLine) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 1);
      if (line) onLine(JSON.parse(line));
    }
  }
  if (buffer.trim()) onLine(JSON.parse(buffer));
}

function onLine(turn, obj) {
  if (obj.error) {
    showFailure(turn, describeError(obj.error, turn.images));
  } else if (obj.done) {
    showDone(turn, obj);
  } else if (obj.delta !== undefined) {
    appendDelta(turn, obj.delta);
  } else if (obj.reasoning !== undefined) {
    appendReasoning(turn, obj.reasoning);
  } else if (obj.conversation_id) {
    state.conversationId = obj.conversation_id;
    if (obj.random_model && $("random-banner").hidden) showRandomBanner();
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("new-conversation").disabled = busy;
  $("stop").disabled = !busy;
  setStatus(busy ? "Answering…" : "");
}

// The "Answer in JSON" option: any JSON object, or JSON valid against the schema typed in.
function responseFormat() {
  const text = $("json-schema").value.trim();
  if (!text) return { type: "json_object" };
  return { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(text), strict: true } };
}

async function ask() {
  const question = $("question").value.trim();
  if (!question || state.controller) return;
  if ($("json-mode").checked) {
    try {
      responseFormat();
    } catch (err) {
      setStatus(`The JSON Schema is not valid JSON: ${err.message}`);
      $("json-schema").focus();
      return;
    }
  }
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const images = state.pending.splice(0);
  renderPreviews();
  $("question").value = "";
  let turn;
  try {
    await Promise.all(images.map((item) => item.ready));
    turn = addTurn(question, images);
    const form = new FormData();
    form.append("prompt", question);
    for (const item of images) form.append("image", item.blob, item.name);
    const headers = authHeaders();
    if (state.conversationId) {
      form.append("conversation_id", state.conversationId);
      headers["X-Conversation-Id"] = state.conversationId; // lets Nginx keep a conversation on one instance
    }
    if ($("max-tokens").value) form.append("max_tokens", $("max-tokens").value);
    if ($("temperature").value) form.append("temperature", $("temperature").value);
    if ($("grounding-mode").checked) form.append("response_format", JSON.stringify({ type: "grounding" }));
    else if ($("json-mode").checked) form.append("response_format", JSON.stringify(responseFormat()));

    const response = await fetch("v1/chat", { method: "POST", body: form, headers, signal: controller.signal });
    if (!response.ok) {
      showFailure(turn, await responseError(response, images));
      return;
    }
    await readLines(response.body, (obj) => onLine(turn, obj));
    if (!turn.finished) showFailure(turn, { message: "The answer was cut off: the connection closed early." });
  } catch (err) {
    if (controller.signal.aborted) showStopped(turn);
    else if (err instanceof SyntaxError) showFailure(turn, { message: `The server sent a line that is not JSON: ${err.message}` });
    else showFailure(turn, { message: `Could not reach the server: ${err.message}` });
  } finally {
    state.controller = null;
    setBusy(false);
    $("question").focus();
  }
}

function stop() {
  if (state.controller) state.controller.abort();
}

function newConversation() {
  state.conversationId = null;
  state.pictures = null;
  $("transcript").replaceChildren();
  setStatus("New conversation.");
  $("question").focus();
}

// ---- wiring --------------------------------------------------------------------------------

function wire() {
  const form = $("ask-form");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    ask();
  });
  $("question").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") stop();
  });
  $("stop").addEventListener("click", stop);
  $("new-conversation").addEventListener("click", newConversation);

  $("images").addEventListener("change", (event) => {
    addFiles(event.target.files);
    event.target.value = ""; // choosing the same file again still fires "change"
  });
  const zone = $("drop-zone");
  zone.addEventListener("dragover", (event) => {
    event.preventDefault();
    zone.classList.add("over");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("over");
    addFiles(event.dataTransfer.files);
  });
  document.addEventListener("paste", (event) => {
    const files = [...event.clipboardData.files];
    if (files.length) addFiles(files);
  });

  $("json-mode").addEventListener("change", (event) => {
    $("json-schema").disabled = !event.target.checked;
  });
  $("show-boxes").addEventListener("change", (event) => {
    document.body.classList.toggle("hide-boxes", !event.target.checked);
  });

  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORAGE) || "";
  key.addEventListener("change", () => {
    if (key.value) sessionStorage.setItem(KEY_STORAGE, key.value);
    else sessionStorage.removeItem(KEY_STORAGE);
    loadModelInfo();
  });
}

wire();
loadModelInfo();
