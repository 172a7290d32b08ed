// The ductor console's live updates: short polling of the JSON the server also renders from.
// No framework, no CDN: this file ships in the wheel.
(function () {
  "use strict";

  var TERMINAL = ["succeeded", "failed", "cancelled", "terminated", "continued", "timed_out"];

  function when(iso) {
    return iso ? iso.replace("T", " ").slice(0, 19) : "";
  }

  function took(start, end) {
    if (!start || !end) return "";
    var s = (Date.parse(end) - Date.parse(start)) / 1000;
    return s < 60 ? s.toFixed(3) + "s" : (s / 60).toFixed(1) + "min";
  }

  function byAttr(name, value) {
    return document.querySelector("[" + name + '="' + CSS.escape(value) + '"]');
  }

  function setStatusClass(el, prefix, status) {
    // getAttribute, not className: an SVG element's className is not a string.
    var cls = el.getAttribute("class") || "";
    var next = /\bst-[a-z_]+/.test(cls)
      ? cls.replace(/\bst-[a-z_]+/, prefix + status)
      : cls + " " + prefix + status;
    el.setAttribute("class", next);
  }

  function applyNode(id, n) {
    var g = byAttr("data-node", id);
    if (g) {
      g.setAttribute("data-status", n.status);
      setStatusClass(g, "st-", n.status);
      var label = g.querySelector(".node-label");
      if (label) label.textContent = n.label;
      var bar = g.querySelector(".progress");
      if (bar && n.scatter && n.scatter.total) {
        var full = parseFloat(bar.getAttribute("data-full"));
        bar.setAttribute("width", String((full * n.scatter.done) / n.scatter.total));
      }
    }
    var row = byAttr("data-row-node", id);
    if (row) {
      var pill = row.querySelector(".c-status .pill");
      if (pill) {
        pill.textContent = n.label;
        setStatusClass(pill, "st-", n.status);
      }
      row.querySelector(".c-attempts").textContent = String(n.attempts);
      row.querySelector(".c-started").textContent = when(n.started_at);
      row.querySelector(".c-took").textContent = took(n.started_at, n.finished_at);
      row.querySelector(".c-error").textContent = n.error || "";
    }
  }

  function applyRun(live) {
    var badge = document.querySelector("[data-run-status]");
    if (badge) {
      badge.setAttribute("data-run-status", live.status);
      badge.textContent = live.status;
      setStatusClass(badge, "st-", live.status);
    }
    Object.keys(live.nodes).forEach(function (id) {
      applyNode(id, live.nodes[id]);
    });
  }

  function runPage(root) {
    var runId = root.getAttribute("data-run-page");
    var every = Math.max(250, parseFloat(root.getAttribute("data-poll")) * 1000);
    var version = parseInt(root.getAttribute("data-version"), 10);
    var node = root.getAttribute("data-node-selected");
    var base = "/runs/" + encodeURIComponent(runId);
    var actions = document.getElementById("actions");
    var edited = false; // never swap the forms under someone's typing
    actions.addEventListener("input", function () { edited = true; });
    actions.addEventListener("submit", function () { edited = false; });
    var status = (document.querySelector("[data-run-status]") || {}).textContent;

    function refreshPanels() {
      var url = base + "/panels" + (node ? "?node=" + encodeURIComponent(node) : "");
      return fetch(url, { cache: "no-store", credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (html === null) return;
          var doc = new DOMParser().parseFromString("<div>" + html + "</div>", "text/html");
          var panels = doc.body.firstChild;
          var fresh = panels.querySelector("#actions-src");
          if (fresh) {
            if (!edited) actions.innerHTML = fresh.innerHTML;
            fresh.remove();
          }
          document.getElementById("panels").innerHTML = panels.innerHTML;
        });
    }

    function poll() {
      fetch(base + "/live", { cache: "no-store", credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (live) {
          if (!live) return;
          applyRun(live);
          var moved = live.record_version !== version;
          status = live.status;
          version = live.record_version;
          if (moved) return refreshPanels();
        })
        .catch(function () { /* the console restarted or the network blinked: try again */ })
        .then(function () {
          // A finished run changes only when redriven: look less often.
          setTimeout(poll, TERMINAL.indexOf(status) >= 0 ? every * 5 : every);
        });
    }
    setTimeout(poll, every);
  }

  function runsPage(root) {
    if (root.getAttribute("data-first-page") !== "1") return; // older pages stay as they are
    var every = Math.max(1000, parseFloat(root.getAttribute("data-poll")) * 1000);
    function poll() {
      fetch(location.href, {
        cache: "no-store",
        credentials: "same-origin",
        headers: { "X-Ductor-Fragment": "rows" },
      })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) { if (html !== null) root.innerHTML = html; })
        .catch(function () {})
        .then(function () { setTimeout(poll, every); });
    }
    setTimeout(poll, every);
  }

  var run = document.querySelector("[data-run-page]");
  if (run) runPage(run);
  var runs = document.querySelector("[data-runs-page]");
  if (runs) runsPage(runs);
})();
