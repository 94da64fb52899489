// mtad-edge chat page: plain JavaScript, no library, no build step.
// Safety: model output, pasted text and whatever localStorage holds are untrusted. They reach the
// DOM only as text nodes (createTextNode / textContent), never as HTML; links keep http(s) only.
// Same origin: relative URLs, Content-Type: application/json on every POST.
"use strict";

(() => {
  const STORE = "mtad-edge.chats.v1"; // conversations and settings, in this browser
  const KEY = "mtad-edge.api-key"; // sessionStorage: this tab only
  const METHODS = ["", "auto", "ar", "sd", "mtad", "mmtad"];
  const SOURCES = ["aux", "ngram", "forced"]; // who drafted a block's kept tokens (forced: a grammar's spans)
  const $ = (id) => document.getElementById(id);

  // -- DOM helpers: every piece of text goes in as a text node -----------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(typeof c === "string" ? document.createTextNode(c) : c);
    return node;
  }
  const svg = (tag, attrs) => {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    return node;
  };

  // -- the store: read defensively (another version, a hand edit, a hostile extension) ------------
  const str = (v, max) => (typeof v === "string" ? v.slice(0, max) : "");
  const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : 0);
  function cleanBlock(b) {
    if (!b || typeof b !== "object") return null;
    const chars = Array.isArray(b.chars) ? b.chars.slice(0, 2).map(num) : [0, 0];
    return {
      tokens: num(b.tokens), drafted: num(b.drafted), accepted: num(b.accepted), calls: num(b.calls),
      steps: num(b.steps), seconds: num(b.seconds), gamma: num(b.gamma), width: b.width == null ? null : num(b.width),
      source: SOURCES.includes(b.source) ? b.source : null, chars: chars.length === 2 ? chars : [0, 0],
    };
  }
  function cleanMessage(m) {
    if (!m || typeof m !== "object" || !["user", "assistant"].includes(m.role)) return null;
    const out = { role: m.role, content: str(m.content, 1 << 22) };
    if (m.role === "assistant") {
      out.blocks = Array.isArray(m.blocks) ? m.blocks.map(cleanBlock).filter(Boolean) : [];
      out.stats = m.stats && typeof m.stats === "object" ? m.stats : null;
      out.error = str(m.error, 2000);
      out.stopped = m.stopped === true;
      out.method = str(m.method, 20);
    }
    return out;
  }
  function cleanChat(c) {
    if (!c || typeof c !== "object" || typeof c.id !== "string") return null;
    return {
      id: c.id.slice(0, 64), title: str(c.title, 200), system: str(c.system, 1 << 20),
      messages: Array.isArray(c.messages) ? c.messages.map(cleanMessage).filter(Boolean) : [],
    };
  }
  function load() {
    let raw = null;
    try {
      raw = JSON.parse(localStorage.getItem(STORE) || "null");
    } catch (e) {
      raw = null;
    }
    const chats = raw && Array.isArray(raw.chats) ? raw.chats.map(cleanChat).filter(Boolean) : [];
    const s = raw && raw.settings && typeof raw.settings === "object" ? raw.settings : {};
    return {
      chats,
      current: raw && typeof raw.current === "string" ? raw.current : null,
      settings: {
        method: METHODS.includes(s.method) ? s.method : "",
        temperature: str(s.temperature, 20), maxTokens: str(s.maxTokens, 20), stop: str(s.stop, 10000),
        showBlocks: s.showBlocks !== false,
      },
    };
  }
  const state = load();
  function save() {
    try {
      localStorage.setItem(STORE, JSON.stringify(state));
    } catch (e) {
      say(`could not save the conversations in this browser: ${e.message}`, true);
    }
  }
  const newId = () => `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
  function current() {
    let chat = state.chats.find((c) => c.id === state.current);
    if (!chat) {
      chat = state.chats[0] || null;
      if (!chat) {
        chat = { id: newId(), title: "", system: "", messages: [] };
        state.chats.unshift(chat);
      }
      state.current = chat.id;
    }
    return chat;
  }
  const titleOf = (c) => c.title || (c.messages.find((m) => m.role === "user") || {}).content || "New chat";

  function say(text, bad) {
    const s = $("status");
    s.textContent = text;
    s.className = bad ? "bad" : "";
  }

  // -- Markdown, safely: a small subset built as DOM nodes -----------------------------------------
  function safeUrl(href) {
    try {
      const u = new URL(href); // absolute only: a relative or scheme-less link stays text
      return u.protocol === "http:" || u.protocol === "https:" ? u.href : null;
    } catch (e) {
      return null;
    }
  }
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*\n]+)\*\*|__([^_\n]+)__|\*([^*\s][^*\n]*)\*|\[([^\]\n]+)\]\(([^)\s]+)\)|(https?:\/\/[^\s<>()"']+[^\s<>()"'.,;:!?])/g;
  function inline(text, parent) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
      last = m.index + m[0].length;
      if (m[1]) parent.append(el("code", { text: m[2] }));
      else if (m[3] || m[4]) inline(m[3] || m[4], parent.appendChild(el("strong")));
      else if (m[5]) inline(m[5], parent.appendChild(el("em")));
      else if (m[6]) {
        const href = safeUrl(m[7]);
        if (href) inline(m[6], parent.appendChild(link(href)));
        else parent.append(document.createTextNode(m[0])); // javascript:, data:, relative: shown as written
      } else {
        const href = safeUrl(m[8]);
        parent.append(href ? link(href, m[8]) : document.createTextNode(m[8]));
      }
    }
    if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
    return parent;
  }
  function link(href, text) {
    const a = el("a", { href, target: "_blank", rel: "noopener noreferrer nofollow" });
    if (text) a.textContent = text;
    return a;
  }
  function codeBlock(lang, text) {
    const code = el("code", { text });
    if (lang) code.dataset.lang = lang;
    const copy = el("button", { type: "button", class: "copy-code", text: "copy" });
    copy.addEventListener("click", () => copyText(text, copy));
    return el("pre", {}, copy, code);
  }
  function markdown(text) {
    const out = document.createDocumentFragment();
    const lines = text.split("\n");
    let para = [];
    const flush = () => {
      if (para.length) out.append(inline(para.join("\n"), el("p")));
      para = [];
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/);
      if (fence) {
        flush();
        const body = [];
        for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) body.push(lines[i]);
        out.append(codeBlock(fence[2], body.join("\n"))); // unclosed (still streaming): to the end
        continue;
      }
      const head = line.match(/^(#{1,6})\s+(.*)$/);
      if (head) {
        flush();
        out.append(inline(head[2], el(`h${head[1].length + 2 > 6 ? 6 : head[1].length + 2}`)));
        continue;
      }
      if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
        flush();
        out.append(el("hr"));
        continue;
      }
      const item = line.match(/^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/);
      if (item) {
        flush();
        const ordered = /\d/.test(item[1]);
        const list = el(ordered ? "ol" : "ul");
        for (; i < lines.length; i++) {
          const it = lines[i].match(/^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/);
          if (!it || /\d/.test(it[1]) !== ordered) break;
          list.append(inline(it[2], el("li")));
        }
        i--;
        out.append(list);
        continue;
      }
      if (/^\s*>/.test(line)) {
        flush();
        const quote = [];
        for (; i < lines.length && /^\s*>/.test(lines[i]); i++) quote.push(lines[i].replace(/^\s*>\s?/, ""));
        i--;
        out.append(inline(quote.join("\n"), el("blockquote")));
        continue;
      }
      if (!line.trim()) flush();
      else para.push(line);
    }
    flush();
    return out;
  }

  // -- blocks: the tokens of each verify call, laid along the text by their characters ------------
  function blockTitle(b, n) {
    const how = b.source
      ? `${b.source} drafted ${b.drafted} (gamma ${b.gamma}${b.width ? `, ${b.width} beams` : ""}), the target kept ${b.accepted}`
      : "a plain step: nothing drafted";
    const ms = (b.seconds * 1000).toFixed(1);
    return `call ${n}: ${b.tokens} token${b.tokens === 1 ? "" : "s"}; ${how}; ${b.calls} target call${b.calls === 1 ? "" : "s"}, ${ms} ms`;
  }
  function shaded(text, blocks) {
    const out = document.createDocumentFragment();
    const cps = Array.from(text); // the server counts characters as code points
    let pos = 0;
    let n = 0;
    for (const b of blocks) {
      if (b.tokens <= 0) continue; // a step that committed nothing (it drew end-of-text)
      n++;
      const span = el("span", { class: `block ${n % 2 ? "even" : "odd"}`, title: blockTitle(b, n) });
      for (const k of ["tokens", "drafted", "accepted", "calls", "gamma"]) span.dataset[k] = String(b[k]);
      span.dataset.source = b.source || "none";
      const kept = cps.slice(pos, pos + b.chars[0]).join("");
      const own = cps.slice(pos + b.chars[0], pos + b.chars[0] + b.chars[1]).join("");
      pos += b.chars[0] + b.chars[1];
      if (kept) span.append(el("span", { class: `kept src-${b.source || "none"}`, text: kept }));
      if (b.drafted > b.accepted) span.append(el("span", { class: "brk", title: "the draft broke off here" }));
      if (own) span.append(el("span", { class: "own", text: own }));
      out.append(span);
    }
    if (pos < cps.length) out.append(document.createTextNode(cps.slice(pos).join("")));
    return out;
  }
  function totals(blocks) {
    const t = { tokens: 0, drafted: 0, accepted: 0, calls: 0, seconds: 0, blocks: 0 };
    for (const b of blocks) {
      for (const k of ["tokens", "drafted", "accepted", "calls", "seconds"]) t[k] += b[k];
      if (b.tokens > 0) t.blocks++;
    }
    return t;
  }
  const fmt = (v, d) => (v == null || !Number.isFinite(v) ? "n/a" : v.toFixed(d));

  // -- rendering ----------------------------------------------------------------------------------
  function renderChats() {
    const list = $("chats");
    list.replaceChildren();
    for (const c of state.chats) {
      const li = el("li", { class: c.id === state.current ? "current" : "" });
      li.dataset.id = c.id;
      const title = el("button", { type: "button", class: "title", text: titleOf(c).slice(0, 60) });
      title.addEventListener("click", () => select(c.id));
      const rename = el("button", { type: "button", class: "act rename", title: "rename", text: "\u270E" });
      rename.addEventListener("click", () => startRename(li, c));
      const del = el("button", { type: "button", class: "act delete", title: "delete", text: "\u00D7" });
      del.addEventListener("click", () => remove(c.id));
      li.append(title, rename, del);
      list.append(li);
    }
  }
  function startRename(li, chat) {
    const input = el("input", { class: "rename-input", value: titleOf(chat) });
    let done = false;
    const finish = (keep) => {
      if (done) return;
      done = true;
      if (keep) chat.title = input.value.trim().slice(0, 200);
      save();
      renderChats();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") finish(true);
      if (e.key === "Escape") finish(false);
    });
    input.addEventListener("blur", () => finish(true));
    li.replaceChildren(input);
    input.focus();
    input.select();
  }
  function renderMessages() {
    const chat = current();
    const box = $("messages");
    box.replaceChildren();
    chat.messages.forEach((m, i) => box.append(messageNode(chat, m, i)));
    box.scrollTop = box.scrollHeight;
    $("system").value = chat.system;
    const last = chat.messages[chat.messages.length - 1];
    renderPanel(last && last.role === "assistant" ? last : null);
  }
  function messageNode(chat, m, i) {
    const node = el("div", { class: `msg ${m.role}` });
    const head = el("div", { class: "head" }, el("span", { text: m.role === "user" ? "you" : `assistant${m.method ? ` \u00B7 ${m.method}` : ""}` }), el("span", { class: "grow" }));
    const copy = el("button", { type: "button", class: "copy", text: "copy" });
    copy.addEventListener("click", () => copyText(m.content, copy));
    head.append(copy);
    if (m.role === "assistant" && i === chat.messages.length - 1 && !busy) {
      const again = el("button", { type: "button", class: "regenerate", text: "regenerate" });
      again.addEventListener("click", regenerate);
      head.append(again);
    }
    node.append(head);
    fillBody(node, m);
    return node;
  }
  function fillBody(node, m) {
    let body = node.querySelector(".body");
    if (!body) node.append((body = el("div", { class: "body" })));
    if (m.role === "user") {
      body.className = "body plain";
      body.textContent = m.content;
    } else if (state.settings.showBlocks && m.blocks.length) {
      body.className = "body blocks";
      body.replaceChildren(shaded(m.content, m.blocks));
    } else {
      body.className = "body md";
      body.replaceChildren(markdown(m.content));
    }
    node.querySelector(".error")?.remove();
    node.querySelector(".foot")?.remove();
    if (m.role !== "assistant") return;
    if (m.error) node.append(el("div", { class: "error", text: m.error }));
    const t = totals(m.blocks);
    const foot = el("div", { class: "foot" });
    for (const k of ["tokens", "drafted", "accepted", "calls", "blocks"]) node.dataset[k] = String(t[k]);
    const parts = [];
    if (t.blocks) {
      parts.push(`${t.tokens} tokens in ${t.calls} target calls (${fmt(t.tokens / t.calls, 2)} a call)`);
      if (t.drafted) parts.push(`acceptance ${fmt((100 * t.accepted) / t.drafted, 1)}% (${t.accepted}/${t.drafted})`);
      parts.push(`${fmt(t.tokens / t.seconds, 1)} tok/s`);
    }
    if (m.stopped) parts.push("stopped");
    foot.append(parts.join(" \u00B7 "));
    if (m.stats) {
      const s = m.stats;
      const same = s.generated === t.tokens && s.drafted === t.drafted && s.accepted === t.accepted && s.target_calls === t.calls;
      node.dataset.addsUp = String(same);
      foot.append(" \u00B7 ", el("span", {
        class: same ? "ok" : "bad",
        text: same ? "\u2713 the blocks add up to mtad_stats" : `\u2717 mtad_stats says ${s.generated} tokens, ${s.drafted} drafted, ${s.accepted} kept, ${s.target_calls} calls`,
      }));
    }
    node.append(foot);
  }
  function renderPanel(m) {
    const live = $("live");
    const chart = $("chart");
    live.replaceChildren();
    chart.replaceChildren();
    $("chart-caption").textContent = "";
    if (!m || !m.blocks.length) {
      live.append(el("span", { class: "muted", text: "Send a message: each verify call's tokens are shaded, and this panel follows the decoding." }));
      return;
    }
    const t = totals(m.blocks);
    const drafting = m.blocks.filter((b) => b.source);
    const lastPlan = drafting.length ? drafting[drafting.length - 1] : null;
    const item = (label, value, id) => el("span", { id }, `${label} `, el("b", { text: value }));
    live.append(
      item("tok/s", fmt(t.tokens / t.seconds, 1), "live-rate"),
      item("tokens", String(t.tokens), "live-tokens"),
      item("target calls", String(t.calls), "live-calls"),
      item("tokens a call", fmt(t.tokens / t.calls, 2), "live-per-call"),
      item("acceptance", t.drafted ? `${fmt((100 * t.accepted) / t.drafted, 1)}%` : "n/a", "live-acceptance"),
      item("gamma", lastPlan ? String(lastPlan.gamma) : "0", "live-gamma"),
      item("beams", lastPlan && lastPlan.width ? String(lastPlan.width) : "-", "live-width"),
    );
    drawChart(chart, m.blocks.filter((b) => b.tokens > 0));
  }
  // Bars: each block's tokens; line: tokens/s over the last few blocks.
  function drawChart(chart, blocks) {
    const W = 600;
    const H = 120;
    const top = 4;
    const maxTokens = Math.max(1, ...blocks.map((b) => b.tokens));
    const rates = blocks.map((_, i) => {
      const win = blocks.slice(Math.max(0, i - 7), i + 1);
      const s = win.reduce((a, b) => a + b.seconds, 0);
      return s > 0 ? win.reduce((a, b) => a + b.tokens, 0) / s : 0;
    });
    const maxRate = Math.max(1e-9, ...rates);
    const step = W / Math.max(blocks.length, 1);
    blocks.forEach((b, i) => {
      const h = ((H - top) * b.tokens) / maxTokens;
      chart.append(svg("rect", { class: `bar src-${b.source || "none"}`, x: i * step + step * 0.1, y: H - h, width: step * 0.8, height: h }));
    });
    const pts = rates.map((r, i) => `${(i + 0.5) * step},${H - ((H - top) * r) / maxRate}`).join(" ");
    if (blocks.length > 1) chart.append(svg("polyline", { class: "rate", points: pts }));
    $("chart-caption").textContent = `bars: tokens a verify call, up to ${maxTokens} \u00B7 line: tok/s over the last 8 calls, up to ${fmt(maxRate, 1)}`;
  }

  // -- actions ------------------------------------------------------------------------------------
  let busy = null; // {controller, message, node} while an answer streams
  function select(id) {
    if (busy) return;
    state.current = id;
    save();
    renderChats();
    renderMessages();
  }
  function remove(id) {
    if (busy && current().id === id) return;
    state.chats = state.chats.filter((c) => c.id !== id);
    if (state.current === id) state.current = null;
    current();
    save();
    renderChats();
    renderMessages();
  }
  function newChat() {
    if (busy) return;
    const chat = { id: newId(), title: "", system: "", messages: [] };
    state.chats.unshift(chat);
    state.current = chat.id;
    save();
    renderChats();
    renderMessages();
    $("input").focus();
  }
  async function copyText(text, button) {
    try {
      await navigator.clipboard.writeText(text);
      button.textContent = "copied";
    } catch (e) {
      button.textContent = "copy failed";
    }
    setTimeout(() => { button.textContent = "copy"; }, 1500);
  }
  function regenerate() {
    const chat = current();
    if (busy || !chat.messages.length) return;
    if (chat.messages[chat.messages.length - 1].role === "assistant") chat.messages.pop();
    answer(chat);
  }
  function sendMessage() {
    const text = $("input").value;
    if (busy || !text.trim()) return;
    const chat = current();
    chat.messages.push({ role: "user", content: text });
    $("input").value = "";
    renderChats();
    answer(chat);
  }

  function requestBody(chat) {
    const s = state.settings;
    const messages = [];
    if (chat.system.trim()) messages.push({ role: "system", content: chat.system });
    for (const m of chat.messages) messages.push({ role: m.role, content: m.content });
    const body = { messages, stream: true, mtad_blocks: true };
    if (s.method) body.method = s.method;
    if (s.temperature !== "") body.temperature = Number(s.temperature);
    if (s.maxTokens !== "") body.max_tokens = Number(s.maxTokens);
    const stop = s.stop.split("\n").filter((x) => x !== "");
    if (stop.length) body.stop = stop;
    return body;
  }
  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(KEY);
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }
  async function errorText(res) {
    try {
      const e = await res.json();
      if (e && e.error && typeof e.error.message === "string") return `${res.status}: ${e.error.message}`;
    } catch (e) { /* not JSON */ }
    return `HTTP ${res.status}`;
  }

  async function answer(chat) {
    const m = { role: "assistant", content: "", blocks: [], stats: null, error: "", stopped: false, method: state.settings.method };
    chat.messages.push(m);
    const controller = new AbortController();
    busy = { controller, message: m, chat };
    renderMessages();
    const node = $("messages").lastElementChild;
    node.classList.add("streaming");
    setBusy(true);
    let frame = 0;
    const paint = () => {
      frame = 0;
      fillBody(node, m);
      renderPanel(m);
      $("messages").scrollTop = $("messages").scrollHeight;
    };
    const later = () => { if (!frame) frame = requestAnimationFrame(paint); };
    try {
      const res = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(requestBody(chat)), signal: controller.signal,
      });
      if (res.status === 401) {
        chat.messages.pop();
        askKey(() => answer(chat));
        return;
      }
      if (!res.ok) throw new Error(await errorText(res));
      await readEvents(res, (obj) => {
        if (obj.error) throw new Error(`server: ${obj.error.message}`);
        const choice = obj.choices && obj.choices[0];
        const piece = choice && choice.delta && choice.delta.content;
        if (typeof piece === "string") m.content += piece;
        if (Array.isArray(obj.mtad_blocks)) m.blocks.push(...obj.mtad_blocks.map(cleanBlock).filter(Boolean));
        if (obj.mtad_stats) {
          m.stats = obj.mtad_stats;
          m.method = typeof m.stats.method === "string" ? m.stats.method : m.method;
        }
        later();
      });
    } catch (e) {
      if (e.name === "AbortError") m.stopped = true;
      else m.error = String(e.message || e);
      controller.abort(); // a bad event: let the rest of the stream go
    } finally {
      if (frame) cancelAnimationFrame(frame);
      if (busy && busy.message === m) {
        busy = null;
        setBusy(false);
        save();
        if (current() === chat) renderMessages();
      }
    }
  }
  // Server-sent events: "data: {json}" lines, events split by a blank line, "[DONE]" last.
  async function readEvents(res, onEvent) {
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += value;
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return;
          onEvent(JSON.parse(data));
        }
      }
    }
  }
  function setBusy(on) {
    $("send").disabled = on;
    $("stop-answer").hidden = !on;
    document.body.classList.toggle("busy", on);
    if (!on) busy = null;
  }
  function stopAnswer() {
    if (busy) busy.controller.abort();
  }

  // -- the API key: asked for where the server answers 401 ----------------------------------------
  let afterKey = null;
  function askKey(then) {
    afterKey = then;
    $("key-overlay").hidden = false;
    $("api-key").focus();
    say("this server needs an API key", true);
  }
  async function checkServer() {
    try {
      const res = await fetch("v1/models", { headers: headers() });
      if (res.status === 401) {
        askKey(checkServer);
        return;
      }
      if (!res.ok) throw new Error(await errorText(res));
      const models = await res.json();
      const id = models && models.data && models.data[0] && models.data[0].id;
      $("model-name").textContent = typeof id === "string" ? id : "";
      $("forget-key").hidden = !sessionStorage.getItem(KEY);
      say("ready");
      document.body.dataset.ready = "true";
    } catch (e) {
      say(`cannot reach the server: ${e.message}`, true);
    }
  }

  // -- wiring -------------------------------------------------------------------------------------
  function bindSettings() {
    const s = state.settings;
    const fields = [["method", "method"], ["temperature", "temperature"], ["max-tokens", "maxTokens"], ["stop", "stop"]];
    for (const [id, key] of fields) {
      $(id).value = s[key];
      $(id).addEventListener("input", () => { s[key] = $(id).value; save(); });
    }
    $("show-blocks").checked = s.showBlocks;
    $("show-blocks").addEventListener("change", () => {
      s.showBlocks = $("show-blocks").checked;
      save();
      renderMessages();
    });
  }
  function start() {
    bindSettings();
    $("new-chat").addEventListener("click", newChat);
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); sendMessage(); });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        sendMessage();
      }
    });
    $("stop-answer").addEventListener("click", stopAnswer);
    $("system").addEventListener("input", () => { current().system = $("system").value; save(); });
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const key = $("api-key").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY, key);
      $("api-key").value = "";
      $("key-overlay").hidden = true;
      const then = afterKey;
      afterKey = null;
      if (then) then();
    });
    $("forget-key").addEventListener("click", () => {
      sessionStorage.removeItem(KEY);
      $("forget-key").hidden = true;
      checkServer();
    });
    current();
    save();
    renderChats();
    renderMessages();
    checkServer();
  }
  start();
})();
