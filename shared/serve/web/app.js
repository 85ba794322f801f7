// moe-pipe's web page (docs/web.md): chat over /v1/chat/completions and a live
// view of the engine from GET /events. No framework, no build step, no eval;
// model output and every server value reach the page as text (textContent),
// never as HTML.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const KEY = "moe-pipe-api-key"; // sessionStorage only: gone when the tab closes
  const MAX_POINTS = 300; // drawn per chart
  const MiB = 1024 * 1024;
  const state = {
    messages: [], // the conversation, sent whole each turn so the engine reuses its cached prefix
    chat: null, // the AbortController of the reply being streamed
    rows: [], // token rows (telemetry), newest last
    points: 0, // rows received on this connection: each chart gains one per token
    first: [],
    slots: [], // what compute's slots are doing (gateway.parallel above 1; none at 1)
    pool: null, // [held, pool]: positions the slots' KV caches hold, of their pool
    hello: null,
    status: null,
    residency: null,
    events: null, // the AbortController of the event stream
    dirty: false,
  };

  // -- helpers -------------------------------------------------------------------
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  const mib = (b) => (b === null || b === undefined ? "–" : (b / MiB).toFixed(b < 10 * MiB ? 2 : 0) + " MiB");
  const fixed = (v, d) => (typeof v === "number" ? v.toFixed(d) : "–");
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  // prompt-progress: begin. A prompt's progress (llama.cpp's prompt_progress) as one line, the text
  // of shared/progress.py prompt_progress_text (tests/test_web.py runs both on the same figures).
  const grouped = (n) => n.toLocaleString("en-US");
  function durationText(s) {
    if (s < 1) return "<1 s";
    const r = Math.round(s);
    if (r < 60) return r + " s";
    if (r < 3600) return `${Math.floor(r / 60)} min ${r % 60} s`;
    return `${Math.floor(r / 3600)} h ${Math.floor((r % 3600) / 60)} min`;
  }
  function promptProgressText(p) {
    let text = `prompt ${grouped(p.processed)} / ${grouped(p.total)} tokens`;
    if (p.cache) text += ` (${grouped(p.cache)} cached)`;
    const done = p.processed - p.cache;
    if (p.processed >= p.total) return text + ` · done in ${durationText(p.time_ms / 1e3)}`;
    if (done > 0 && p.time_ms > 0) return text + ` · ${durationText(((p.total - p.processed) * p.time_ms) / done / 1e3)} left`;
    return text;
  }
  // prompt-progress: end

  // slots: begin. One of compute's slots (gateway.parallel) as one line, the text of
  // shared/progress.py slot_text (tests/test_web.py runs both on the same figures).
  function slotText(s) {
    const n = (x) => x.toLocaleString("en-US");
    const head = `slot ${s.id}`;
    if (s.state === "idle") return `${head} idle`;
    if (s.state === "prompt") return `${head} prompt ${n(s.processed)} / ${n(s.total)} tokens` + (s.cache ? ` (${n(s.cache)} cached)` : "");
    return `${head} decoding, ${n(s.decoded)} token${s.decoded === 1 ? "" : "s"}`;
  }
  // How full the slots' KV pool is: shared/progress.py pool_text.
  function poolText(held, pool) {
    return `KV pool ${held.toLocaleString("en-US")} / ${pool.toLocaleString("en-US")} positions`;
  }
  // slots: end

  function authHeaders(extra) {
    const h = Object.assign({}, extra || {});
    const key = sessionStorage.getItem(KEY);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  function askKey(message) {
    $("keybox").hidden = false;
    $("keymsg").textContent = message;
    $("key").focus();
  }

  function setConn(text, cls) {
    const c = $("conn");
    c.textContent = text;
    c.className = "pill " + (cls || "");
  }

  // Server-sent events over fetch (EventSource cannot send the Authorization header).
  async function* sseEvents(resp) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) yield { event, data: data.join("\n") };
      }
    }
  }

  // -- views ---------------------------------------------------------------------
  for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => show(b.dataset.view));

  function show(view) {
    for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b.dataset.view === view);
    for (const s of document.querySelectorAll(".view")) s.hidden = s.id !== "view-" + view;
    redraw();
  }

  // -- chat ----------------------------------------------------------------------
  function addTurn(role, text) {
    const turn = el("div", "turn " + role);
    if (role === "user") {
      turn.textContent = text;
    } else {
      const details = el("details");
      details.hidden = true;
      details.append(el("summary", null, "reasoning"));
      const reasoning = el("div", "reasoning");
      details.append(reasoning);
      const answer = el("div", "answer");
      const note = el("div", "note");
      turn.append(details, answer, note);
      turn.parts = { details, reasoning, answer, note };
    }
    $("messages").append(turn);
    $("messages").scrollTop = $("messages").scrollHeight;
    return turn;
  }

  function busy(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
    $("chat-status").textContent = on ? "generating…" : "";
  }

  async function send(text) {
    const userTurn = addTurn("user", text);
    state.messages.push({ role: "user", content: text });
    const turn = addTurn("assistant");
    const p = turn.parts;
    const ctrl = new AbortController();
    state.chat = ctrl;
    busy(true);
    let answer = "";
    let reasoning = "";
    let failed = false;
    try {
      const resp = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: authHeaders({ "Content-Type": "application/json" }),
        body: JSON.stringify({
          model: (state.hello && state.hello.model) || "default",
          messages: state.messages,
          stream: true,
          return_progress: true, // llama.cpp's field: chunks with prompt_progress while the prompt is computed
          chat_template_kwargs: { enable_thinking: $("think").checked },
        }),
        signal: ctrl.signal,
      });
      if (resp.status === 401) {
        state.messages.pop();
        userTurn.remove();
        turn.remove();
        $("prompt").value = text;
        askKey("this service needs its API key");
        return;
      }
      if (!resp.ok) {
        const body = await resp.json().catch(() => null);
        throw new Error((body && body.error && body.error.message) || resp.status + " " + resp.statusText);
      }
      for await (const ev of sseEvents(resp)) {
        if (ev.data === "[DONE]") break;
        const chunk = JSON.parse(ev.data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.prompt_progress) {
          $("chat-status").textContent = promptProgressText(chunk.prompt_progress);
          continue;
        }
        const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
        if (delta.reasoning_content || delta.content) $("chat-status").textContent = "generating…";
        if (delta.reasoning_content) {
          reasoning += delta.reasoning_content;
          p.reasoning.textContent = reasoning;
          p.details.hidden = false;
        }
        if (delta.content) {
          answer += delta.content;
          p.answer.textContent = answer;
        }
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    } catch (e) {
      if (e.name === "AbortError") {
        p.note.textContent = "stopped";
      } else {
        failed = true;
        p.note.textContent = "error: " + e.message;
        p.note.classList.add("error");
      }
    } finally {
      state.chat = null;
      busy(false);
    }
    if (failed && !answer && !reasoning) {
      state.messages.pop(); // nothing came back: the turn is not part of the conversation
      return;
    }
    const reply = { role: "assistant", content: answer };
    if (reasoning) reply.reasoning_content = reasoning;
    state.messages.push(reply);
  }

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.chat) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.chat && state.chat.abort()); // the gateway sends compute a Cancel
  $("clear").addEventListener("click", () => {
    if (state.chat) state.chat.abort();
    state.messages = [];
    $("messages").replaceChildren();
  });

  $("keybox").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    $("key").value = "";
    $("keybox").hidden = true;
    startEvents();
  });

  // -- the event stream ----------------------------------------------------------
  function startEvents() {
    if (state.events) state.events.abort();
    const ctrl = new AbortController();
    state.events = ctrl;
    followEvents(ctrl);
  }

  async function followEvents(ctrl) {
    let retry = 0;
    while (!ctrl.signal.aborted) {
      try {
        const resp = await fetch("/events", { headers: authHeaders(), signal: ctrl.signal, cache: "no-store" });
        if (resp.status === 401) {
          setConn("key needed", "bad");
          askKey("this service needs its API key");
          return;
        }
        if (!resp.ok) throw new Error("status " + resp.status);
        setConn("live", "ok");
        retry = 0;
        for await (const ev of sseEvents(resp)) onEvent(ev.event, JSON.parse(ev.data));
      } catch (e) {
        if (ctrl.signal.aborted) return;
      }
      setConn("reconnecting", "bad"); // the gateway restarted or the network dropped: try again, no reload
      await sleep(Math.min(5000, 250 * 2 ** retry++));
    }
  }

  // warming: begin. The reader's warm start from the last run's hot set (status.warming) while it
  // runs, the text of shared/experts/hotset.py WarmProgress.text (tests/test_web.py runs both).
  function warmingText(w) {
    const n = (x) => x.toLocaleString("en-US");
    return w && w.state === "warming" ? `warming ${n(w.done)}/${n(w.total)} experts` : "";
  }
  // warming: end

  function renderWarming(w) {
    $("warming").textContent = warmingText(w);
    $("warming").hidden = !$("warming").textContent;
  }

  function expertsUsed(hello) {
    const k = hello.n_expert_used, own = hello.n_expert_used_model;
    return `${k} a token` + (k === own ? "" : ` (n_expert_used, LOSSY: the model's own is ${own})`);
  }

  // steady: begin. The reply's steady rate as every figure of moe-pipe takes it (docs/telemetry.md
  // § Run summary): its tokens over the wall of the last quarter of its rows so far; a row of a
  // verify pass counts its kept drafts too (tests/test_web.py runs it against the telemetry's).
  function steadyText(rows) {
    const req = rows.length ? rows[rows.length - 1].req_id : undefined;
    const reply = rows.filter((r) => r.req_id === req);
    const tail = reply.slice(reply.length - Math.max(1, Math.floor(reply.length / 4)));
    const ms = tail.reduce((a, r) => a + r.wall_ms, 0);
    const tokens = tail.reduce((a, r) => a + 1 + (r.accepted || 0), 0);
    return ms > 0 ? ((1000 * tokens) / ms).toFixed(1) + " tok/s" : "";
  }
  // steady: end

  function onEvent(kind, data) {
    if (kind === "hello") {
      const gen = data.config && data.config.generate;
      if (!state.hello && gen) $("think").checked = !gen.no_think; // the service's default until the user chooses
      state.hello = data;
      state.rows = data.history.slice(-MAX_POINTS);
      state.points = data.history.length;
      state.first = data.first;
      $("model").textContent = data.model + (data.layers ? ` · ${data.layers} layers × ${data.experts} experts, ${expertsUsed(data)}` : "");
      renderConfig(data.config);
      renderFirst();
    } else if (kind === "token") {
      state.rows.push(data);
      if (state.rows.length > MAX_POINTS) state.rows.shift();
      state.points += 1;
      $("rate").textContent = steadyText(state.rows);
    } else if (kind === "prompt") {
      $("rate").textContent = promptProgressText(data); // any client's prompt; the next token shows tok/s again
    } else if (kind === "slots") {
      state.slots = data.slots;
      state.pool = data.pool ? [data.held, data.pool] : null;
      renderSlots();
    } else if (kind === "residency") {
      state.residency = data;
    } else if (kind === "status") {
      state.status = data;
      state.first = data.first || state.first;
      renderFirst();
      renderSystem();
      renderWarming(data.supervisor && data.supervisor.warming);
    }
    for (const id of ["chart-ms", "chart-rate", "chart-hit", "chart-read"]) $(id).dataset.points = state.points;
    redraw();
  }

  // -- drawing -------------------------------------------------------------------
  function redraw() {
    if (state.dirty) return;
    state.dirty = true;
    requestAnimationFrame(() => {
      state.dirty = false;
      drawCharts();
      drawHeatmap();
    });
  }

  function css(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }

  function sizeCanvas(canvas, height) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth;
    const h = height || canvas.clientHeight;
    if (!w || !h) return null; // its view is hidden
    if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
      canvas.width = Math.round(w * ratio);
      canvas.height = Math.round(h * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    return { ctx, w, h };
  }

  function drawChart(id, series, digits, ceiling) {
    const canvas = $(id);
    const got = sizeCanvas(canvas);
    if (!got) return;
    const { ctx, w, h } = got;
    ctx.clearRect(0, 0, w, h);
    const rows = state.rows;
    const left = 44;
    const bottom = h - 16;
    let max = 0;
    for (const s of series) for (const r of rows) max = Math.max(max, s.value(r) || 0);
    max = ceiling || (max > 0 ? max * 1.1 : 1);
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = css("--muted");
    ctx.strokeStyle = css("--line");
    ctx.lineWidth = 1;
    for (let i = 0; i <= 4; i++) {
      const y = 6 + ((bottom - 6) * i) / 4;
      ctx.beginPath();
      ctx.moveTo(left, y);
      ctx.lineTo(w, y);
      ctx.stroke();
      ctx.fillText(((max * (4 - i)) / 4).toFixed(digits), 2, y + 4);
    }
    if (rows.length) ctx.fillText(`step ${rows[0].step} … ${rows[rows.length - 1].step}`, left, h - 3);
    const dx = (w - left) / Math.max(1, rows.length - 1);
    for (const s of series) {
      ctx.strokeStyle = css(s.color);
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      rows.forEach((r, i) => {
        const x = left + i * dx;
        const y = bottom - ((bottom - 6) * (s.value(r) || 0)) / max;
        if (i) ctx.lineTo(x, y);
        else ctx.moveTo(x, y);
      });
      ctx.stroke();
    }
  }

  function drawCharts() {
    if ($("view-live").hidden) return;
    drawChart(
      "chart-ms",
      [
        { color: "--wall", value: (r) => r.wall_ms },
        { color: "--compute", value: (r) => r.compute_ms },
        { color: "--io", value: (r) => r.io_ms },
        { color: "--stall", value: (r) => r.stall_ms },
      ],
      1,
    );
    drawChart("chart-rate", [{ color: "--compute", value: (r) => (r.wall_ms > 0 ? 1000 / r.wall_ms : 0) }], 1);
    drawChart("chart-hit", [{ color: "--io", value: (r) => r.hit_pct }], 0, 100);
    drawChart("chart-read", [{ color: "--landed", value: (r) => r.read_bytes / MiB }], 2);
  }

  function bits(b64) {
    const raw = atob(b64);
    const out = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out;
  }
  const bitAt = (bytes, i) => (bytes[i >> 3] >> (7 - (i & 7))) & 1; // numpy packbits: first cell in the high bit

  // A cell's colour, the first that applies: its read is under way, a request pins it (an in-flight
  // read pins too, so in flight goes first), it landed since the last frame, it is resident.
  const CELL_STATES = [
    { name: "not cached", color: "--empty" },
    { name: "resident", color: "--resident" },
    { name: "landed since the last frame", color: "--landed" },
    { name: "pinned", color: "--pinned" },
    { name: "read in flight", color: "--inflight" },
  ];
  const cellMasks = (r) => ({
    resident: bits(r.resident),
    landed: bits(r.landed),
    pinned: bits(r.pinned),
    inflight: bits(r.inflight),
  });
  function cellState(m, i) {
    if (bitAt(m.inflight, i)) return 4;
    if (bitAt(m.pinned, i)) return 3;
    if (bitAt(m.landed, i)) return 2;
    return bitAt(m.resident, i);
  }

  function drawHeatmap() {
    const r = state.residency;
    const canvas = $("heatmap");
    if (!r) return;
    const masks = cellMasks(r);
    const cells = r.layers * r.experts;
    let count = 0;
    let pinned = 0;
    let inflight = 0;
    for (let i = 0; i < cells; i++) {
      count += bitAt(masks.resident, i);
      pinned += bitAt(masks.pinned, i);
      inflight += bitAt(masks.inflight, i);
    }
    // what the page shows, counted from the cells themselves
    canvas.dataset.resident = count;
    canvas.dataset.pinned = pinned;
    canvas.dataset.inflight = inflight;
    const sup = state.status && state.status.supervisor;
    const cache = sup && sup.slab_bytes ? ` · ${mib(count * sup.slab_bytes)} of the ${mib(sup.budget_bytes)} expert cache` : "";
    $("heat-caption").textContent =
      `${count} of ${r.layers} × ${r.experts} experts resident, ${pinned} pinned, ${inflight} in flight${cache} ` +
      "(rows: layers, columns: experts)";
    if ($("view-cache").hidden) return;
    const cell = Math.max(2, Math.min(24, Math.floor(canvas.clientWidth / r.experts)));
    const got = sizeCanvas(canvas, cell * r.layers);
    if (!got) return;
    canvas.style.height = cell * r.layers + "px";
    const { ctx, w } = got;
    ctx.clearRect(0, 0, w, cell * r.layers);
    const colors = CELL_STATES.map((s) => css(s.color));
    for (let l = 0; l < r.layers; l++) {
      for (let e = 0; e < r.experts; e++) {
        ctx.fillStyle = colors[cellState(masks, l * r.experts + e)];
        ctx.fillRect(e * cell, l * cell, cell - (cell > 3 ? 1 : 0), cell - (cell > 3 ? 1 : 0));
      }
    }
    canvas.cell = cell;
  }

  $("heatmap").addEventListener("mousemove", (e) => {
    const r = state.residency;
    const cell = $("heatmap").cell;
    if (!r || !cell) return;
    const l = Math.floor(e.offsetY / cell);
    const x = Math.floor(e.offsetX / cell);
    if (l >= r.layers || x >= r.experts) return;
    const s = CELL_STATES[cellState(cellMasks(r), l * r.experts + x)];
    $("heat-cell").textContent = `layer ${l}, expert ${x}: ${s.name}`;
  });

  // -- tables --------------------------------------------------------------------
  function row(cells, classes) {
    const tr = el("tr");
    cells.forEach((c, i) => {
      const td = el("td", classes && classes[i], c);
      tr.append(td);
    });
    return tr;
  }

  function renderFirst() {
    const body = $("first").tBodies[0];
    body.replaceChildren(
      ...state.first.map((r) =>
        row([r.step, fixed(r.wall_ms, 1), fixed(r.compute_ms, 1), fixed(r.io_ms, 1), fixed(r.stall_ms, 1), fixed(r.read_bytes / MiB, 2), fixed(r.hit_pct, 1)]),
      ),
    );
  }

  function renderSlots() {
    $("slots").replaceChildren(
      ...state.slots.map((s) => {
        const li = el("li", "slot " + s.state, slotText(s));
        li.dataset.state = s.state;
        return li;
      }),
    );
    $("kv-pool").textContent = state.pool ? poolText(...state.pool) : "";
    $("slots-box").hidden = state.slots.length < 2; // one slot: the header's prompt line and tok/s say it all
  }

  function renderConfig(config) {
    const body = $("config").tBodies[0];
    const rows = [];
    for (const [table, keys] of Object.entries(config || {})) {
      for (const [k, v] of Object.entries(keys)) rows.push(row([`${table}.${k}`, v === null ? "unset" : typeof v === "object" ? JSON.stringify(v) : v]));
    }
    if (!rows.length) rows.push(row(["(this gateway was started without its config)"]));
    body.replaceChildren(...rows);
  }

  function memoryRow(label, bytes, scale) {
    const bar = el("div", "bar");
    bar.style.width = scale && bytes ? Math.min(100, (100 * bytes) / scale).toFixed(1) + "%" : "0";
    const cell = el("td");
    cell.append(bar);
    const tr = row([label, mib(bytes)], [null, "num"]);
    tr.append(cell);
    return tr;
  }

  function renderSystem() {
    const s = state.status;
    if (!s) return;
    const sup = s.supervisor;
    const mem = s.memory || {};
    const limit = mem.cgroup_limit_bytes || mem.host_total_bytes;
    const used = state.residency && sup ? Number($("heatmap").dataset.resident) * sup.slab_bytes : null;
    const parts = [
      ["expert cache budget", sup ? sup.budget_bytes : null],
      ["expert cache in use", used],
      ["dense set", mem.dense_bytes],
      ["KV cache (ctx_size)", mem.kv_bytes],
    ];
    if (sup) {
      parts.push(["supervisor RSS", sup.rss_bytes]);
      for (const p of sup.processes) parts.push([p.name + " RSS", p.rss_bytes]);
    }
    // the bars compare the parts with each other (the largest is full): against a host's RAM most would not show
    const scale = Math.max(1, ...parts.map(([, b]) => b || 0));
    const rows = [row([mem.cgroup_limit_bytes ? "memory limit (cgroup)" : "memory (host)", mib(limit)], [null, "num"])];
    for (const [label, bytes] of parts) rows.push(memoryRow(label, bytes, scale));
    $("memory").tBodies[0].replaceChildren(...rows);
    const procs = (sup && sup.processes) || [];
    $("procs").tBodies[0].replaceChildren(
      ...procs.map((p) => {
        const tr = row(
          [p.name, p.state, p.pid || "–", p.restarts, p.uptime_s === null ? "–" : p.uptime_s + " s", mib(p.rss_bytes), p.last_error || ""],
          [null, "state-" + p.state, "num", "num", "num", "num", null],
        );
        tr.dataset.name = p.name;
        tr.dataset.restarts = p.restarts;
        tr.dataset.state = p.state;
        return tr;
      }),
    );
    const health = sup ? `health ${sup.health}, budget: ${sup.budget}` : "no supervisor answered";
    $("health").textContent = `(${health}; compute ${s.compute_ready ? "ready" : "not ready"}, ${s.queue} waiting)`;
  }

  window.addEventListener("resize", redraw);
  startEvents();
})();
