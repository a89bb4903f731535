// The dashboard's only script: live updates over server-sent events (the server renders
// every fragment; this patches it into the page in place), ticking ages, the charts'
// hover readout, and a confirmation before a command is sent.
(() => {
  "use strict";
  const live = document.getElementById("live");
  const stream = document.body.dataset.stream;

  function ago(seconds) {
    seconds = Math.max(0, seconds);
    if (seconds < 120) return Math.floor(seconds) + "s ago";
    if (seconds < 7200) return Math.floor(seconds / 60) + "m ago";
    if (seconds < 172800) return Math.floor(seconds / 3600) + "h ago";
    return Math.floor(seconds / 86400) + "d ago";
  }

  function tick() {
    const now = Date.now() / 1000;
    for (const cell of document.querySelectorAll(".age[data-ts]")) {
      const text = ago(now - parseFloat(cell.dataset.ts));
      if (cell.textContent !== text) cell.textContent = text;
    }
  }
  setInterval(tick, 1000);

  document.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-confirm]");
    if (button && !window.confirm(button.dataset.confirm)) event.preventDefault();
  });

  // Patching: the new fragment is parsed, then the live element's children are made
  // like it node by node. Elements keep their identity where they match (same tag and
  // the same id or data-key), so what the reader did to them stays: a <details> they
  // opened stays open (its "open" is the reader's, never the server's), focus, text
  // selection and scroll stay where they were.
  function keyOf(node) {
    if (node.nodeType !== Node.ELEMENT_NODE) return null;
    return node.tagName + "#" + (node.id || node.dataset.key || "");
  }

  function patchAttributes(from, to) {
    for (const { name, value } of Array.from(to.attributes)) {
      if (from.getAttribute(name) !== value) from.setAttribute(name, value);
    }
    for (const { name } of Array.from(from.attributes)) {
      if (name === "open" && from.tagName === "DETAILS") continue;
      if (!to.hasAttribute(name)) from.removeAttribute(name);
    }
  }

  function patchChildren(from, to) {
    const wanted = Array.from(to.childNodes);
    const spare = new Map();
    for (const child of Array.from(from.childNodes)) {
      const key = keyOf(child);
      if (key && key.indexOf("#") < key.length - 1 && !spare.has(key)) spare.set(key, child);
    }
    let cursor = from.firstChild;
    for (const next of wanted) {
      const key = keyOf(next);
      let match = key ? spare.get(key) : undefined;
      if (match) spare.delete(key);
      else if (cursor && cursor.nodeType === next.nodeType && keyOf(cursor) === key &&
               (!key || key.endsWith("#"))) match = cursor;
      if (match) {
        if (match !== cursor) from.insertBefore(match, cursor);
        else cursor = cursor.nextSibling;
        patch(match, next);
      } else {
        from.insertBefore(next, cursor);
      }
    }
    while (cursor) {
      const after = cursor.nextSibling;
      cursor.remove();
      cursor = after;
    }
  }

  function patch(from, to) {
    if (from.nodeType !== Node.ELEMENT_NODE) {
      if (from.nodeValue !== to.nodeValue) from.nodeValue = to.nodeValue;
      return;
    }
    if (from.hasAttribute("data-reader")) return; // the reader's: a readout, its guide
    patchAttributes(from, to);
    patchChildren(from, to);
  }

  function apply(element, html) {
    const fresh = element.cloneNode(false);
    fresh.innerHTML = html;
    patchChildren(element, fresh);
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
    tick();
  }

  // Charts: the figure carries its times and each line its values; the readout says the
  // values at the time under the pointer and a guide line marks it.
  function readout(figure, event) {
    const svg = figure.querySelector("svg");
    const times = (figure.dataset.times || "").split(",").filter(Boolean).map(Number);
    if (!svg || !times.length) return;
    const box = svg.getBoundingClientRect();
    const x = (event.clientX - box.left) * (svg.viewBox.baseVal.width / box.width);
    const x0 = Number(figure.dataset.x0), x1 = Number(figure.dataset.x1);
    const start = Number(figure.dataset.start), end = Number(figure.dataset.end);
    const at = start + (Math.min(Math.max(x, x0), x1) - x0) / (x1 - x0) * (end - start);
    let index = 0;
    for (let i = 1; i < times.length; i++) {
      if (Math.abs(times[i] - at) < Math.abs(times[index] - at)) index = i;
    }
    const when = new Date(times[index] * 1000).toISOString().slice(11, 16) + " UTC";
    const unit = figure.dataset.unit ? " " + figure.dataset.unit : "";
    const said = [];
    for (const line of figure.querySelectorAll("g.series")) {
      const value = (line.dataset.values || "").split(",")[index];
      if (value !== undefined && value !== "") said.push(line.dataset.name + " " + value + unit);
    }
    figure.querySelector("output.readout").textContent =
      when + ": " + (said.join(", ") || "no value");
    const guide = figure.querySelector("line.guide");
    const gx = x0 + (times[index] - start) / (end - start) * (x1 - x0);
    guide.setAttribute("x1", gx);
    guide.setAttribute("x2", gx);
    guide.classList.add("on");
  }
  document.addEventListener("mousemove", (event) => {
    const figure = event.target.closest && event.target.closest("figure.chart");
    if (figure) readout(figure, event);
  });

  if (!stream) return;
  // EventSource reconnects by itself after a dropped connection; after a refusal (too
  // many pages open, the login ended) it gives up, so the page tries again in 5 s. The
  // server ends each stream after a while with a "reconnect" event: a new one opens at
  // once. The banner says while the stream is down.
  function connect() {
    const source = new EventSource(stream);
    source.onopen = () => {
      live.textContent = "live";
      live.className = "live on";
    };
    source.onerror = () => {
      live.textContent = "disconnected: reconnecting…";
      live.className = "live off";
      if (source.readyState === EventSource.CLOSED) setTimeout(connect, 5000);
    };
    source.addEventListener("reconnect", () => {
      source.close();
      connect();
    });
    for (const element of document.querySelectorAll("[data-live][id]")) {
      source.addEventListener(element.id, (event) => apply(element, event.data));
    }
  }
  connect();
})();
