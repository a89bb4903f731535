// The dashboard's only script: live updates over server-sent events (the server renders
// every fragment), ticking ages, and a confirmation before a command is sent.
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
      cell.textContent = ago(now - parseFloat(cell.dataset.ts));
    }
  }
  setInterval(tick, 1000);

  document.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-confirm]");
    if (button && !window.confirm(button.dataset.confirm)) event.preventDefault();
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
    for (const id of ["rows", "pager", "counts", "aggregators", "detail", "charts", "results"]) {
      source.addEventListener(id, (event) => {
        const element = document.getElementById(id);
        if (element) element.innerHTML = event.data;
        tick();
      });
    }
    source.addEventListener("alert", (event) => {
      const feed = document.getElementById("alerts");
      if (!feed) return;
      feed.insertAdjacentHTML("afterbegin", event.data);
      while (feed.children.length > 50) feed.lastElementChild.remove();
    });
  }
  connect();
})();
