// tokenway console: one page per hash (#overview, #keys, ...) over the admin API.
// The admin token is exchanged for an HttpOnly session cookie at login and never kept by this script.
// Every change carries the session's CSRF token (X-Tokenway-CSRF), received at login or from
// GET /ui/session and kept only in this closure: a page of another origin can read neither.
// Every value from the gateway is inserted with textContent (never as HTML).
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const page = $("page");
  let timers = [];
  let csrfToken = "";
  let charts = [];
  // Who is logged in ({actor, role, teams, user}), from the login answer or GET /ui/session. The page
  // hides what this role may not do; the gateway refuses it anyway (403), whatever the page shows.
  let identity = { role: "admin", teams: [] };
  const mayManageKeys = () => identity.role === "admin" || identity.role === "team_admin";
  // A team admin reads its teams' rows only: the gateway filters every answer (gateway/http/team_scope.py);
  // the page only says so, on the pages whose data it narrows.
  const teamNote = (what) => (identity.role === "team_admin"
    ? el("p", { class: "muted team-note", "data-team-scope": identity.teams.join(",") }, `${what} of your teams only (${identity.teams.join(", ")}).`)
    : "");

  // ------------------------------------------------------------------ helpers
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : v);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  class AuthError extends Error {}
  class StaleError extends Error {}  // the page changed while a call was in flight: drop its answer
  let pageGen = 0;
  const quiet = (e) => e instanceof AuthError || e instanceof StaleError;

  async function api(method, path, body) {
    const gen = pageGen;
    const response = await fetch(path, {
      method,
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-Tokenway-CSRF": csrfToken },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await response.text();
    let doc = null;
    try { doc = text ? JSON.parse(text) : null; } catch (_) { doc = { raw: text }; }
    if (gen !== pageGen) throw new StaleError("page changed");
    if (response.status === 401) { showLogin(); throw new AuthError("logged out"); }
    if (!response.ok) {
      const message = doc && doc.error ? doc.error.message : `${response.status} ${response.statusText}`;
      throw new Error(message);
    }
    return doc;
  }

  const fmt = {
    num: (v, d = 0) => (v === null || v === undefined ? "–" : Number(v).toLocaleString(undefined, { maximumFractionDigits: d, minimumFractionDigits: d })),
    usd: (v) => (v === null || v === undefined ? "–" : "$" + Number(v).toFixed(Math.abs(v) >= 1 ? 2 : 6)),
    pct: (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %"),
    ms: (v) => (v === null || v === undefined ? "–" : Number(v).toFixed(1) + " ms"),
    // every time the console shows: YYYY-MM-DD HH:MM:SS in UTC (an ISO string or unix seconds)
    time: (v) => {
      if (v === null || v === undefined || v === "") return "–";
      const d = typeof v === "number" ? new Date(v * 1000) : new Date(v);
      return Number.isNaN(d.getTime()) ? String(v) : d.toISOString().slice(0, 19).replace("T", " ");
    },
    limits: (obj) => Object.entries(obj || {}).map(([k, v]) => `${k}=${v}`).join(", ") || "–",
  };

  function pill(text) { return el("span", { class: `pill ${text}` }, text); }

  function table(columns, rows, opts = {}) {
    const head = el("tr", {}, columns.map((c) => el("th", { class: c.num ? "num" : null }, c.label)));
    const body = rows.map((row) => {
      const tr = el("tr", { "data-id": opts.idOf ? opts.idOf(row) : null },
        columns.map((c) => {
          const value = c.render ? c.render(row) : row[c.key];
          return el("td", { class: c.num ? "num" : null }, value === null || value === undefined ? "–" : value);
        }));
      return tr;
    });
    return el("table", { id: opts.id }, el("thead", {}, head), el("tbody", {}, body));
  }

  // ---- lists: a text search and a status filter over rows, and the shown rows as a CSV file
  function listTools(prefix, statuses, placeholder, onChange) {
    const search = el("input", { id: `${prefix}-search`, type: "search", placeholder, size: 26, oninput: onChange });
    const status = statuses ? el("select", { id: `${prefix}-status`, onchange: onChange },
      ["", ...statuses].map((s) => el("option", { value: s }, s || "any"))) : null;
    const csv = el("button", { type: "button", class: "small secondary", id: `${prefix}-csv` }, "Export CSV");
    const node = el("div", { class: "toolbar" }, el("label", {}, "Search", search), status ? el("label", {}, "Status", status) : null, csv);
    return { node, search, status, csv };
  }

  // rows whose named fields contain every word of the search text (case-insensitive), of the chosen status
  function filtered(rows, fields, tools) {
    const words = tools.search.value.toLowerCase().split(/\s+/).filter(Boolean);
    const want = tools.status ? tools.status.value : "";
    return rows.filter((row) => {
      if (want && row.status !== want) return false;
      const text = fields.map((f) => f(row) ?? "").join(" ").toLowerCase();
      return words.every((w) => text.includes(w));
    });
  }

  // a cell as text; a leading = + - @ is quoted with ' so that a spreadsheet never runs it as a formula
  function csvCell(v) {
    let text = v === null || v === undefined ? "" : v instanceof Node ? v.textContent : String(v);
    if (/^[=+@\t\r]/.test(text) || /^-[^0-9.]/.test(text)) text = "'" + text;
    return /[",\n\r]/.test(text) ? `"${text.replaceAll('"', '""')}"` : text;
  }

  function csvOf(columns, rows) {
    const shown = columns.filter((c) => c.label && !c.noCsv);
    const line = (cells) => cells.map(csvCell).join(",");
    return [line(shown.map((c) => c.label)),
      ...rows.map((row) => line(shown.map((c) => (c.csv ? c.csv(row) : c.render ? c.render(row) : row[c.key]))))].join("\r\n") + "\r\n";
  }

  function download(name, text) {
    const url = URL.createObjectURL(new Blob([text], { type: "text/csv;charset=utf-8" }));
    const a = el("a", { href: url, download: name });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  }

  const stamp = () => new Date().toISOString().slice(0, 19).replaceAll(":", "").replace("T", "-");

  function stat(label, value, id) {
    return el("div", { class: "stat", id }, el("div", { class: "label" }, label), el("div", { class: "value" }, value));
  }

  // an event handler's failure shown on the page instead of an unhandled rejection
  const guard = (fn) => async (...args) => { try { await fn(...args); } catch (e) { if (!quiet(e)) page.append(errorBox(e)); } };

  function every(ms, fn) {
    const run = () => fn().catch((e) => { if (!quiet(e)) page.append(errorBox(e)); });
    run();
    timers.push(setInterval(run, ms));
  }

  function clearPage() {
    pageGen += 1;
    for (const t of timers) clearInterval(t);
    timers = [];
    for (const c of charts) c.destroy();
    charts = [];
    page.replaceChildren();
  }

  function chart(container, title, xs, series, opts = {}) {
    const palette = ["#2f5bd3", "#1f8a4c", "#c0392b", "#b7791f", "#7b3fb8", "#0f8b8d", "#d35400", "#546e7a", "#111"];
    const width = Math.max(400, container.clientWidth || 560);
    const plot = new uPlot({
      title,
      width,
      height: opts.height || 220,
      series: [{}, ...series.map((s, i) => ({
        label: s.label, stroke: s.color || palette[i % palette.length], width: s.width || 1.5,
        value: (u, v) => (v === null ? "–" : opts.value ? opts.value(v) : v),
      }))],
      // time axes and legends in UTC, like every time the console shows
      tzDate: (ts) => uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"),
      axes: [{ label: "UTC", labelSize: 18 }, { size: opts.axisSize || 70, values: (u, ticks) => ticks.map((t) => (opts.axis ? opts.axis(t) : t)) }],
      scales: { x: opts.xRange ? { time: true, range: () => opts.xRange } : { time: true } },
    }, [xs, ...series.map((s) => s.data)], container);
    charts.push(plot);
    return plot;
  }

  function form(fields, submitLabel, onSubmit, id) {
    const inputs = {};
    const node = el("form", { class: "inline", id }, fields.map((f) => {
      const input = f.options
        ? el("select", { name: f.name, id: `${id}-${f.name}` }, f.options.map((o) => el("option", { value: o }, o)))
        : el("input", { name: f.name, id: `${id}-${f.name}`, placeholder: f.placeholder || "", type: f.type || "text", size: f.size || 10 });
      inputs[f.name] = input;
      return el("label", {}, f.label, input);
    }), el("button", { type: "submit", id: `${id}-submit` }, submitLabel));
    const error = el("p", { class: "error", role: "alert", id: `${id}-error` });
    node.addEventListener("submit", async (event) => {
      event.preventDefault();
      error.textContent = "";
      const values = {};
      for (const [name, input] of Object.entries(inputs)) if (input.value.trim() !== "") values[name] = input.value.trim();
      try { await onSubmit(values, inputs); } catch (e) { if (!quiet(e)) error.textContent = e.message; }
    });
    return el("div", {}, node, error);
  }

  const LIMIT_FIELDS = [
    { name: "rpm", label: "RPM", type: "number", size: 6 },
    { name: "tpm", label: "TPM", type: "number", size: 8 },
    { name: "tpd", label: "TPD", type: "number", size: 9 },
    { name: "max_concurrent", label: "Concurrent", type: "number", size: 5 },
    { name: "usd_per_day", label: "USD / day", type: "number", size: 6 },
    { name: "usd_per_month", label: "USD / month", type: "number", size: 6 },
  ];

  function limitsOf(values) {
    const limits = {};
    for (const f of LIMIT_FIELDS) if (values[f.name] !== undefined) limits[f.name] = Number(values[f.name]);
    return limits;
  }

  function modelsOf(text) { return text ? text.split(",").map((m) => m.trim()).filter(Boolean) : undefined; }

  function errorBox(e) { return el("p", { class: "error" }, e.message || String(e)); }

  // ------------------------------------------------------------------ overview
  async function overview() {
    page.append(el("h1", {}, "Overview"), el("p", { class: "muted", id: "overview-window" }, "The last hour of this replica."));
    const cards = el("div", { class: "cards", id: "overview-cards" });
    const grid = el("div", { class: "charts" });
    const c1 = el("div", { class: "card" }), c2 = el("div", { class: "card" }), c3 = el("div", { class: "card" });
    const c4 = el("div", { class: "card", id: "chart-model-latency" }), c5 = el("div", { class: "card", id: "chart-model-errors" });
    grid.append(c1, c2, c3, c4, c5);
    page.append(cards, grid);
    every(5000, async () => {
      const doc = await api("GET", "/admin/activity");
      if (!doc.summary) {  // an older gateway withheld the overview from a team admin
        grid.hidden = true;
        $("overview-window").textContent = "The overview sums every team's requests, so it is shown to viewers and admins only.";
        cards.replaceChildren(el("p", { id: "overview-withheld" }, "Your teams' requests: ",
          el("a", { href: "#usage" }, "Usage"), " and ", el("a", { href: "#tail" }, "Live tail"), "."));
        return;
      }
      // a team admin's: its teams' own minute counters; the per-model charts sum every team's requests
      const teams = doc.team_scope ? doc.team_scope.teams : null;
      c4.hidden = c5.hidden = Boolean(doc.team_scope && (doc.team_scope.withheld || []).includes("models"));  // an older gateway's
      const s = doc.summary;
      cards.replaceChildren(
        stat("Requests / s", fmt.num(s.requests_per_s, 2), "stat-rps"),
        stat("Tokens / s", fmt.num(s.tokens_per_s, 0), "stat-tps"),
        stat("Spend / hour", fmt.usd(s.spend_per_hour_usd), "stat-spend"),
        stat("CPM (USD / M tokens)", s.cpm_usd === null ? "–" : "$" + s.cpm_usd.toFixed(4), "stat-cpm"),
        stat("Error rate", fmt.pct(s.error_rate), "stat-errors"),
        stat("Rejected", fmt.pct(s.rejection_rate), "stat-rejected"),
        stat("Fallback rate", fmt.pct(s.fallback_rate), "stat-fallbacks"),
        stat("SLO attainment", fmt.pct(s.slo_attainment), "stat-slo"),
      );
      $("overview-window").textContent = teams
        ? `The last ${Math.round(s.window_s / 60)} min of your teams (${teams.join(", ")}): ${fmt.num(s.requests)} requests.`
        : `The last ${Math.round(s.window_s / 60)} min of this replica: ${fmt.num(s.requests)} requests.`;
      for (const c of charts) c.destroy();
      charts = [];
      for (const c of [c1, c2, c3, c4, c5]) c.replaceChildren();
      const m = doc.minutes;
      const xs = m.map((r) => r.t);
      chart(c1, "Requests per minute", xs, [
        { label: "served", data: m.map((r) => r.served) },
        { label: "rejected", data: m.map((r) => r.rejected) },
        { label: "errors", data: m.map((r) => r.errors) },
      ]);
      chart(c2, "Tokens per minute", xs, [
        { label: "input", data: m.map((r) => r.input_tokens) },
        { label: "output", data: m.map((r) => r.output_tokens) },
      ]);
      chart(c3, "Spend per minute (USD)", xs, [{ label: "USD", data: m.map((r) => r.cost_usd) }],
        { value: (v) => "$" + v.toFixed(6), axis: (t) => "$" + Number(t.toPrecision(2)), axisSize: 90 });
      const models = doc.models || [];
      const of = (r, name) => (r.models || {})[name];
      const latency = [];
      for (const name of models) {
        latency.push({ label: `${name} mean`, data: m.map((r) => { const c = of(r, name); return c && c.served ? c.duration_sum_ms / c.served : null; }) });
        if (m.some((r) => (of(r, name) || {}).ttft_n)) latency.push({ label: `${name} TTFT p90`, data: m.map((r) => ttftP90(of(r, name))) });
      }
      chart(c4, "Latency per model (ms)", xs, latency, { value: (v) => v.toFixed(1) + " ms", axis: (t) => t + " ms" });
      chart(c5, "Errors per minute per model", xs, models.map((name) => ({ label: name, data: m.map((r) => (of(r, name) || {}).errors || 0) })));
      c4.dataset.models = c5.dataset.models = models.join(",");
    });
  }

  // the 90th percentile TTFT of a minute's fixed buckets: the upper bound of the bucket that holds it
  // (within that bucket's width); above the last bound, the minute's mean
  function ttftP90(c) {
    if (!c || !c.ttft_n) return null;
    const bounds = Object.keys(c.ttft_le_ms).filter((b) => b !== "inf").map(Number).sort((a, b) => a - b);
    let seen = 0;
    for (const b of bounds) { seen += c.ttft_le_ms[String(b)]; if (seen >= 0.9 * c.ttft_n) return b; }
    return Math.max(bounds[bounds.length - 1], c.ttft_sum_ms / c.ttft_n);
  }

  // ------------------------------------------------------------------ keys
  async function keys() {
    page.append(el("h1", {}, "API keys"));
    const tenants = (await api("GET", "/admin/tenants")).data.map((t) => t.name);
    const result = el("div", { id: "key-result" });
    const createCard = !mayManageKeys() ? result : el("div", { class: "card" }, el("h2", {}, "Create a key"),
      form([
        { name: "tenant", label: "Tenant", options: tenants },
        { name: "id", label: "Id (optional)", placeholder: "tenant-xxxxxx", size: 14 },
        { name: "models", label: "Models (comma)", placeholder: "all of the tenant's", size: 16 },
        ...LIMIT_FIELDS,
        { name: "expires_in", label: "Expires in", placeholder: "30d", size: 5 },
        { name: "owner", label: "Owner", size: 10 },
        { name: "team", label: "Team", size: 10 },
        { name: "description", label: "Description", size: 18 },
      ], "Create key", async (v, inputs) => {
        const body = { tenant: v.tenant, limits: limitsOf(v), metadata: {} };
        if (v.id) body.id = v.id;
        if (v.models) body.models = modelsOf(v.models);
        if (v.expires_in) body.expires_in = v.expires_in;
        for (const k of ["owner", "team", "description"]) if (v[k]) body.metadata[k] = v[k];
        const made = await api("POST", "/admin/keys", body);
        for (const [name, input] of Object.entries(inputs)) if (input.tagName === "INPUT") input.value = "";
        showSecret(result, made.key.id, made.secret, "created");
        await refresh();
      }, "create-key"), result);
    const tools = listTools("keys", ["active", "revoked", "expired", "disabled"], "id, tenant, team, owner", () => show());
    const listCard = el("div", { class: "card" }, el("h2", {}, "Keys"), tools.node);
    const detail = el("div", { id: "key-detail" });
    page.append(createCard, listCard, detail);
    let allKeys = [];
    const searched = [(k) => k.id, (k) => k.tenant, (k) => k.team, (k) => (k.metadata || {}).owner];
    const columns = [
      { label: "Id", render: (k) => k.source === "api" ? el("a", { href: "#", class: "key-link", onclick: guard(async (e) => { e.preventDefault(); await showKey(k.id); }) }, k.id) : k.id },
      { label: "Tenant", key: "tenant" },
      { label: "Team", key: "team" },
      { label: "Source", key: "source" },
      { label: "Status", render: (k) => pill(k.status), csv: (k) => k.status },
      { label: "Spend today", num: true, render: (k) => fmt.usd((k.spend_usd || {}).day), csv: (k) => (k.spend_usd || {}).day },
      { label: "Spend this month", num: true, render: (k) => fmt.usd((k.spend_usd || {}).month), csv: (k) => (k.spend_usd || {}).month },
      { label: "Models", render: (k) => (k.models || ["*"]).join(", ") },
      { label: "Own limits", render: (k) => fmt.limits(k.limits) },
      { label: "Last used (UTC)", render: (k) => fmt.time(k.last_used_at) },
      { label: "Owner", render: (k) => (k.metadata || {}).owner },
      { label: "", render: (k) => k.source === "api" && k.status !== "revoked" && mayManageKeys() ? keyActions(k) : "" },
    ];
    tools.csv.addEventListener("click", () => download(`tokenway-keys-${stamp()}.csv`, csvOf(columns, filtered(allKeys, searched, tools))));

    function show() {
      const old = $("keys-table");
      const node = table(columns, filtered(allKeys, searched, tools), { id: "keys-table", idOf: (k) => k.id });
      if (old) old.replaceWith(node); else listCard.append(node);
    }

    async function refresh() {
      allKeys = (await api("GET", "/admin/keys?include_revoked=1&spend=1")).data;
      show();
    }

    function keyActions(k) {
      const revoke = el("button", { class: "small danger", "data-action": "revoke", onclick: guard(async () => {
        if (revoke.dataset.armed !== "1") { revoke.dataset.armed = "1"; revoke.textContent = "Confirm revoke"; return; }
        await api("DELETE", `/admin/keys/${encodeURIComponent(k.id)}`);
        detail.replaceChildren();
        await refresh();
      }) }, "Revoke");
      const rotate = el("button", { class: "small secondary", "data-action": "rotate", onclick: guard(async () => {
        const made = await api("POST", `/admin/keys/${encodeURIComponent(k.id)}/rotate`, { grace_s: 3600 });
        showSecret(result, k.id, made.secret, "rotated (the old secret works for one more hour)");
        await refresh();
      }) }, "Rotate");
      return el("span", {}, rotate, " ", revoke);
    }

    async function showKey(id) {
      const k = await api("GET", `/admin/keys/${encodeURIComponent(id)}`);
      const standing = k.standing || { spend_usd: {}, budget_left_usd: {}, limits: [] };
      detail.replaceChildren(el("div", { class: "card detail", id: "key-standing" },
        el("h2", {}, `Key ${k.id}`),
        el("div", { class: "kv" },
          el("span", {}, "tenant ", el("b", {}, k.tenant)),
          el("span", {}, "status ", pill(k.status)),
          el("span", {}, "created ", el("b", {}, fmt.time(k.created_at) + " UTC")),
          el("span", {}, "expires ", el("b", {}, k.expires_at ? fmt.time(k.expires_at) + " UTC" : "–")),
          el("span", {}, "hint ", el("code", {}, k.hint || "")),
          el("span", {}, "spend today ", el("b", { id: "key-spend-day" }, fmt.usd(standing.spend_usd.day))),
          el("span", {}, "this month ", el("b", { id: "key-spend-month" }, fmt.usd(standing.spend_usd.month))),
          el("span", {}, "budget left today ", el("b", {}, fmt.usd(standing.budget_left_usd.day))),
        ),
        limitsTable(standing.limits),
        mayManageKeys() ? el("h2", {}, "Edit its own limits") : null,
        mayManageKeys() ? form(LIMIT_FIELDS, "Save limits", async (v) => {
          await api("PATCH", `/admin/keys/${encodeURIComponent(id)}`, { limits: limitsOf(v) });
          await showKey(id);
          await refresh();
        }, "edit-key") : null,
        el("button", { class: "small secondary", id: "key-refresh", onclick: guard(() => showKey(id)) }, "Refresh"),
      ));
    }

    await refresh();
  }

  function showSecret(node, id, secret, what) {
    node.replaceChildren(el("div", { class: "secret" },
      el("div", {}, `Key ${id} ${what}. Its secret is shown once: copy it now.`),
      el("code", { id: "new-secret" }, secret)));
  }

  function limitsTable(rows) {
    return table([
      { label: "Kind", key: "kind" },
      { label: "Scope", key: "scope" },
      { label: "Rule", key: "rule" },
      { label: "Subject", key: "subject" },
      { label: "Dimension", key: "dimension" },
      { label: "Limit", num: true, render: (r) => fmt.num(r.limit ?? r.capacity ?? r.limit_usd, r.kind === "budget" ? 2 : 0) },
      { label: "Remaining", num: true, render: (r) => fmt.num(r.remaining ?? r.remaining_usd ?? (r.capacity - (r.active || 0)), r.kind === "budget" ? 4 : 0) },
      { label: "Used", render: (r) => usedBar(r) },
      { label: "Reset", num: true, render: (r) => (r.reset_s === undefined || r.reset_s === null ? null : r.reset_s.toFixed(1) + " s") },  // null: an agent run's cap, never reset
      { label: "Shadow", render: (r) => (r.shadow ? "yes" : "") },
    ], rows || [], { id: "limits-table" });
  }

  function usedBar(r) {
    const limit = r.limit ?? r.capacity ?? r.limit_usd;
    const used = r.used ?? r.active ?? r.spent_usd ?? 0;
    const share = limit ? Math.min(1, used / limit) : 0;
    const bar = el("div", { class: "bar", title: `${used} of ${limit}` }, el("span", {}));
    bar.firstChild.style.width = (100 * share).toFixed(1) + "%";
    return bar;
  }

  // ------------------------------------------------------------------ tenants
  async function tenantsPage() {
    page.append(el("h1", {}, "Tenants"));
    const listCard = el("div", { class: "card" }, el("h2", {}, "Tenants"));
    const teamField = identity.role === "team_admin"
      ? { name: "team", label: "Team", options: identity.teams }  // a team admin's tenant is of its team
      : { name: "team", label: "Team", placeholder: "none", size: 10 };
    if (mayManageKeys()) page.append(el("div", { class: "card" }, el("h2", {}, "Create a tenant"), form([
      { name: "name", label: "Name", size: 12 },
      teamField,
      { name: "models", label: "Models (comma)", placeholder: "all", size: 16 },
      { name: "priority", label: "Priority", options: ["normal", "critical", "high", "low", "sheddable"] },
      ...LIMIT_FIELDS,
      { name: "description", label: "Description", size: 18 },
    ], "Create tenant", async (v, inputs) => {
      const body = { name: v.name, priority: v.priority, limits: limitsOf(v), metadata: {} };
      if (v.team) body.team = v.team;
      if (v.models) body.models = modelsOf(v.models);
      if (v.description) body.metadata.description = v.description;
      await api("POST", "/admin/tenants", body);
      for (const input of Object.values(inputs)) if (input.tagName === "INPUT") input.value = "";
      await refresh();
    }, "create-tenant")), listCard);

    const tools = listTools("tenants", null, "name, team, owner", () => show());
    listCard.append(tools.node);
    let allTenants = [];
    const searched = [(t) => t.name, (t) => t.team, (t) => (t.metadata || {}).owner];
    const columns = [
      { label: "Name", key: "name" },
      { label: "Team", key: "team" },
      { label: "Spend today", num: true, render: (t) => fmt.usd((t.spend_usd || {}).day), csv: (t) => (t.spend_usd || {}).day },
      { label: "Spend this month", num: true, render: (t) => fmt.usd((t.spend_usd || {}).month), csv: (t) => (t.spend_usd || {}).month },
      { label: "Source", key: "source" },
      { label: "Priority", key: "priority" },
      { label: "Models", render: (t) => (t.models || ["*"]).join(", ") },
      { label: "Fallback", render: (t) => (t.allow_fallback ? "allowed" : "no") },
      { label: "SLO class", key: "slo_class" },
      { label: "Own limits", render: (t) => fmt.limits(t.limits) },
      { label: "", render: (t) => t.source === "api" && mayManageKeys() ? el("span", {},
        el("button", { class: "small secondary", "data-action": "edit", onclick: () => editTenant(t) }, "Edit limits"), " ",
        el("button", { class: "small danger", "data-action": "delete", onclick: async () => {
          try { await api("DELETE", `/admin/tenants/${encodeURIComponent(t.name)}`); detail.replaceChildren(); await refresh(); }
          catch (e) { if (!quiet(e)) detail.replaceChildren(errorBox(e)); }
        } }, "Delete")) : "" },
    ];
    tools.csv.addEventListener("click", () => download(`tokenway-tenants-${stamp()}.csv`, csvOf(columns, filtered(allTenants, searched, tools))));

    function show() {
      const old = $("tenants-table");
      const node = table(columns, filtered(allTenants, searched, tools), { id: "tenants-table", idOf: (t) => t.name });
      if (old) old.replaceWith(node); else listCard.append(node);
    }

    async function refresh() {
      allTenants = (await api("GET", "/admin/tenants?spend=1")).data;
      show();
    }

    function editTenant(t) {
      detail.replaceChildren(el("div", { class: "card detail", id: "tenant-edit" },
        el("h2", {}, `Tenant ${t.name}: its own limits (now ${fmt.limits(t.limits)})`),
        form(LIMIT_FIELDS, "Save limits", async (v) => {
          await api("PATCH", `/admin/tenants/${encodeURIComponent(t.name)}`, { limits: limitsOf(v) });
          detail.replaceChildren();
          await refresh();
        }, "edit-tenant")));
    }

    const detail = el("div", { id: "tenant-detail" });
    page.append(detail);
    await refresh();
  }

  // ------------------------------------------------------------------ usage
  async function usagePage() {
    // where the records came from, said after each load: every replica's (the ledger's stream) or this one's files
    const origin = el("p", { class: "muted", id: "usage-origin" }, "From the usage ledger.");
    page.append(el("h1", {}, "Spend and usage"), origin, teamNote("Requests"));
    const range = el("select", { id: "usage-range" }, ["1h", "6h", "24h", "7d", "30d"].map((r) => el("option", { value: r, selected: r === "24h" }, r)));
    const by = el("select", { id: "usage-by" }, ["tenant", "key", "model", "pool", "tenant,model", "key,model", "tenant,pool", "model,pool"].map((b) => el("option", { value: b }, b)));
    const go = el("button", { id: "usage-go" }, "Show");
    const csv = el("button", { type: "button", class: "secondary", id: "usage-csv", disabled: true }, "Export CSV");
    const chartCard = el("div", { class: "card" });
    const tableCard = el("div", { class: "card" });
    page.append(el("div", { class: "toolbar" }, el("label", {}, "Range", range), el("label", {}, "Group by", by), go, csv), chartCard, tableCard);
    // the CSV comes from the gateway (GET /admin/usage?format=csv): every group, not only those shown
    csv.addEventListener("click", () => {
      const link = el("a", { href: `/admin/usage?since=${encodeURIComponent(range.value)}&by=${encodeURIComponent(by.value)}&format=csv`, download: "" });
      document.body.append(link);
      link.click();
      link.remove();
    });
    async function load() {
      const doc = await api("GET", `/admin/usage?since=${encodeURIComponent(range.value)}&by=${encodeURIComponent(by.value)}`);
      origin.textContent = usageOrigin(doc);
      for (const c of charts) c.destroy();
      charts = [];
      chartCard.replaceChildren();
      const slots = doc.series.slots;
      const lines = Object.entries(doc.series.lines);
      if (slots.length && lines.length) {
        chart(chartCard, `Spend per ${bucketLabel(doc.series.bucket_s)} by ${doc.by.join(", ")}`, slots,
          lines.map(([label, data]) => ({ label, data, width: label === "all" ? 2.5 : 1.5, color: label === "all" ? "#111" : undefined })),
          { height: 280, value: (v) => "$" + v.toFixed(6), axis: (t) => "$" + Number(t.toPrecision(2)), axisSize: 90,
            xRange: [Math.min(doc.since, slots[0]), Math.max(doc.until, slots[slots.length - 1])] });
      } else {
        chartCard.append(el("p", { class: "muted" }, "No usage in this range."));
      }
      const fields = doc.by.map((f) => ({ label: f, render: (r) => r[f] || "(none)" }));
      const columns = [
        ...fields,
        { label: "Requests", num: true, render: (r) => fmt.num(r.requests) },
        { label: "Served", num: true, render: (r) => fmt.num(r.served) },
        { label: "Rejected", num: true, render: (r) => fmt.num(r.rejected) },
        { label: "Errors", num: true, render: (r) => fmt.num(r.errors) },
        { label: "Input tok", num: true, render: (r) => fmt.num(r.input_tokens) },
        { label: "Output tok", num: true, render: (r) => fmt.num(r.output_tokens) },
        { label: "Cost", num: true, render: (r) => fmt.usd(r.cost_usd) },
        // each group's share of the range's tokens and dollars: by pool, what spilled to an overflow pool
        { label: "Token share", num: true, render: (r) => share(r.input_tokens + r.output_tokens, doc.total.input_tokens + doc.total.output_tokens) },
        { label: "$ share", num: true, render: (r) => share(r.cost_usd, doc.total.cost_usd) },
        { label: "CPM", num: true, render: (r) => (r.cpm_usd === null ? "–" : "$" + r.cpm_usd.toFixed(4)) },
        { label: "TTFT p50", num: true, render: (r) => fmt.ms(r.ttft_p50_ms) },
        { label: "TTFT p90", num: true, render: (r) => fmt.ms(r.ttft_p90_ms) },
      ];
      const rows = [...doc.rows, { ...doc.total, ...Object.fromEntries(doc.by.map((f, i) => [f, i === 0 ? "TOTAL" : ""])) }];
      csv.disabled = false;
      tableCard.replaceChildren(table(columns, rows, { id: "usage-table" }));
    }
    go.addEventListener("click", () => load().catch((e) => { if (!quiet(e)) chartCard.replaceChildren(errorBox(e)); }));
    await load();
  }

  // a partial answer says so: a stream trimmed by its cap, or unreachable (this replica's files instead)
  function usageOrigin(doc) {
    if (doc.source === "redis-stream") {
      const since = doc.covers_since ? ` It holds records from ${fmt.time(doc.covers_since)} UTC on: older ones were trimmed by its cap.` : "";
      return "Every replica's records, from the ledger's Redis stream." + since;
    }
    const failed = doc.stream_error ? ` The ledger's Redis stream did not answer (${doc.stream_error}): every replica's records are not shown.` : "";
    return "This replica's records, from its ledger files." + failed;
  }

  function share(part, whole) { return whole > 0 ? (100 * part / whole).toFixed(1) + " %" : "–"; }

  function bucketLabel(s) { return s % 86400 === 0 ? `${s / 86400} d` : s % 3600 === 0 ? `${s / 3600} h` : `${s / 60} min`; }

  // ------------------------------------------------------------------ limits
  async function limitsPage() {
    page.append(el("h1", {}, "Limits"), el("p", { class: "muted" }, "Every bucket, concurrency limit and budget this replica has touched, as it stands now."),
      teamNote("Limits and overrides"));
    const status = el("div", { class: "kv", id: "policy-status" });
    const card = el("div", { class: "card" });
    page.append(status, card);
    every(5000, async () => {
      const doc = await api("GET", "/admin/status");
      const p = doc.policy;
      status.replaceChildren(...[
        el("span", {}, "policy ", el("b", {}, p.path || "–")),
        el("span", {}, "generation ", el("b", {}, p.generation)),
        el("span", {}, "store ", el("b", {}, doc.admission.store)),
        el("span", {}, "decisions ", el("b", {}, Object.entries(doc.admission.decisions || {}).map(([k, v]) => `${k} ${v}`).join(", ") || "–")),
        p.last_error ? el("span", { class: "error" }, "last reload rejected: " + p.last_error.join("; ")) : null,
      ].filter(Boolean));
      const rows = (doc.limits || []).filter((r) => r.rule !== "@spend").map((r) => ({
        ...r,
        limit: r.capacity ?? r.limit_usd,
        used: r.used ?? r.active ?? r.spent_usd,
        remaining: r.remaining ?? r.remaining_usd ?? (r.capacity - (r.active || 0)),
        dimension: r.dimension || (String(r.period).startsWith("billing:") ? "usd_per_period" : `usd_per_${r.period}`),
      }));
      card.replaceChildren(rows.length ? limitsTable(rows) : el("p", { class: "muted" }, "No limit has been used yet."));
    });
    overridesCard();
  }

  // Temporary overrides of a policies.yaml rule (POST/GET/DELETE /admin/overrides, docs/governance.md)
  const OVERRIDE_DIMENSIONS = ["usd_per_day", "usd_per_month", "usd_per_period", "usd_per_run", "rpm", "rpd", "tpm",
    "tpd", "max_concurrent", "calls_per_run", "tokens_per_run", "seconds_per_run"];

  function overridesCard() {
    const admin = identity.role === "admin";
    const list = el("div", { id: "overrides-list" });
    const card = el("div", { class: "card", id: "overrides" }, el("h2", {}, "Temporary overrides"),
      el("p", { class: "muted" }, "A rule's limit changed until a time, then back by itself (every replica)."));
    if (admin) card.append(form([
      { name: "rule", label: "Rule", placeholder: "team-daily", size: 14 },
      { name: "subject", label: "Subject", placeholder: "every", size: 10 },
      { name: "dimension", label: "Dimension", options: OVERRIDE_DIMENSIONS },
      { name: "value", label: "Value", type: "number", size: 8 },
      { name: "for", label: "For", placeholder: "2h", size: 5 },
      { name: "reason", label: "Reason", size: 16 },
    ], "Override", async (v, inputs) => {
      const body = { rule: v.rule, dimension: v.dimension, value: Number(v.value), for: v.for };
      if (v.subject) body.subject = v.subject;
      if (v.reason) body.reason = v.reason;
      await api("POST", "/admin/overrides", body);
      for (const input of Object.values(inputs)) if (input.tagName === "INPUT") input.value = "";
      await refresh();
    }, "override-create"));
    card.append(list);
    page.append(card);
    async function refresh() {
      const doc = await api("GET", "/admin/overrides");
      const columns = [
        { label: "Rule", key: "rule" }, { label: "Subject", render: (o) => o.subject || "every" },
        { label: "Dimension", key: "dimension" }, { label: "Value", key: "value", num: true },
        { label: "Until (UTC)", render: (o) => fmt.time(o.until) }, { label: "Reason", key: "reason" },
      ];
      if (admin) columns.push({ label: "", render: (o) => el("button", { class: "small danger", "data-action": "end-override",
        onclick: guard(async () => { await api("DELETE", `/admin/overrides/${encodeURIComponent(o.id)}`); await refresh(); }) },
        "End now") });
      list.replaceChildren(doc.data.length ? table(columns, doc.data, { id: "overrides-table", idOf: (o) => o.id })
        : el("p", { class: "muted" }, "No override is active."));
    }
    every(5000, refresh);
  }

  // ------------------------------------------------------------------ pools
  const KNOWN_POOL = new Set(["name", "model", "engine", "endpoints", "states", "ready", "total", "disaggregated", "reason"]);

  // /admin/pools (autoscaled pools): replicas current/desired per role, and what the planner decided
  function replicaFields(auto) {
    return Object.entries(auto.roles || {}).map(([role, r]) => el("span", { class: "replicas", "data-role": role },
      `${role === "both" ? "" : role + " "}replicas current/desired `,
      el("b", {}, `${r.current ?? "–"}/${r.desired ?? "–"}`)));
  }

  function perRole(counts) {
    return Object.entries(counts || {}).map(([role, n]) => (role === "both" ? `${n}` : `${role} ${n}`)).join(", ");
  }

  function decisionList(auto) {
    const decisions = Array.isArray(auto.decisions) ? auto.decisions : [];
    const events = Array.isArray(auto.events) ? auto.events : [];
    if (!decisions.length && !events.length) return null;
    const when = fmt.time;
    return el("div", { class: "decisions" },
      decisions.length ? el("h2", {}, "Recent decisions") : null,
      decisions.length ? el("ul", { class: "pool-decisions" }, decisions.slice(-10).reverse().map((d) => el("li", {},
        `${when(d.at_unix_s)} UTC: ${perRole(d.current)} → ${perRole(d.desired)}`, el("span", { class: "muted" }, ` · ${d.reason || ""}`)))) : null,
      events.length ? el("h2", {}, "Recent actions") : null,
      events.length ? el("ul", { class: "pool-events" }, events.slice(-10).reverse().map((e) => el("li", {},
        `${when(e.at_unix_s)} UTC: ${e.action} ${e.role} ${e.endpoint}`, e.detail ? el("span", { class: "muted" }, ` · ${e.detail}`) : null))) : null);
  }

  function scalarFields(obj, known) {
    return Object.entries(obj).filter(([k, v]) => !known.has(k) && (v === null || typeof v !== "object"));
  }

  // "Test this model": one max_tokens=1 request through the gateway (gateway/console/check.py); the
  // answers outlive the page's 5-second redraws
  function modelCheck(model, results) {
    const out = el("span", { class: "check-result", "data-model": model });
    const show = (node, r) => node.replaceChildren(r.running ? el("span", { class: "muted" }, "checking…")
      : el("span", {}, pill(r.ok ? "ok" : "error"), ` ${r.status} in ${fmt.num(r.latency_ms, 0)} ms`,
        r.endpoint ? ` via ${r.endpoint}` : "", r.error ? el("span", { class: "error" }, ` ${r.error.code}: ${r.error.message || ""}`) : "",
        el("span", { class: "muted" }, ` · ${fmt.time(r.at)} UTC`)));
    const showAll = () => { for (const node of document.querySelectorAll(".check-result")) if (node.dataset.model === model) show(node, results[model]); };
    if (results[model]) show(out, results[model]);
    const button = el("button", { class: "small secondary", "data-action": "check", "data-model": model, onclick: guard(async () => {
      results[model] = { running: true };
      showAll();
      try { results[model] = { ...(await api("POST", `/admin/models/${encodeURIComponent(model)}/check`)), at: Date.now() / 1000 }; }
      catch (e) { if (quiet(e)) throw e; results[model] = { ok: false, status: "–", error: { code: "failed", message: e.message }, at: Date.now() / 1000 }; }
      showAll();
    }) }, "Test this model");
    return el("span", { class: "model-check" }, button, " ", out);
  }

  async function poolsPage() {
    page.append(el("h1", {}, "Pools and endpoints"));
    const holder = el("div", { id: "pools" });
    const checks = {};
    page.append(holder);
    every(5000, async () => {
      const doc = await api("GET", "/admin/backends");
      let extra = {};
      try {
        const pools = await api("GET", "/admin/pools");  // autoscaling, when the gateway has it
        for (const p of pools.pools || []) extra[p.name] = p;
      } catch (e) { if (quiet(e)) throw e; extra = {}; }
      holder.replaceChildren(...doc.pools.map((pool) => {
        const auto = extra[pool.name] || {};
        const merged = { ...auto, ...pool };
        return el("div", { class: "card", "data-pool": pool.name },
          el("h2", {}, `${pool.name} `, el("span", { class: "muted" }, `${pool.model} · ${pool.engine}`)),
          identity.role === "admin" ? modelCheck(pool.model, checks) : null,
          el("div", { class: "kv" },
            el("span", {}, "ready ", el("b", {}, `${pool.ready}/${pool.total}`)),
            pool.disaggregated ? el("span", {}, el("b", {}, "prefill/decode")) : null,
            ...replicaFields(auto),
            auto.reason ? el("span", { class: "pool-reason" }, "autoscale ", el("b", {}, auto.reason)) : null,
            scalarFields(merged, KNOWN_POOL).map(([k, v]) => el("span", {}, `${k.replaceAll("_", " ")} `, el("b", {}, v === null ? "–" : String(v)))),
          ),
          table([
            { label: "Endpoint", key: "id" },
            { label: "State", render: (e) => pill(e.state + (e.stats_stale && e.state === "ready" ? " (stale)" : "")) },
            { label: "Role", key: "role" },
            { label: "Running", num: true, key: "running" },
            { label: "Waiting", num: true, key: "waiting" },
            { label: "KV usage", render: (e) => { const b = usedBar({ used: e.kv_usage_ratio, limit: 1 }); b.title = fmt.pct(e.kv_usage_ratio); return el("span", { class: "with-bar" }, b, fmt.pct(e.kv_usage_ratio)); } },
            { label: "In flight", num: true, key: "inflight_requests" },
            { label: "Restarts", num: true, key: "restarts" },
            { label: "Stats age", num: true, render: (e) => (e.stats_age_s === null ? "–" : e.stats_age_s.toFixed(2) + " s") },
            { label: "Reason", key: "reason" },
            { label: "URL", key: "url" },
          ], pool.endpoints),
          decisionList(auto),
        );
      }));
    });
  }

  // ------------------------------------------------------------------ LoRA adapters
  // per pool serving an adapter's base model, per replica: the adapters there (running or waiting
  // on the engine, held by the gateway, listed by the engine), memory against the pool's budget,
  // and the gateway's loads, preloads, evictions and unloads there (docs/adapters.md)
  function adapterNames(r) {
    return r.adapters.filter((a) => a.held || a.listed).map((a) => a.name + (a.inflight ? ` (${a.inflight})` : "")).join(", ") || "–";
  }

  async function adaptersPage() {
    page.append(el("h1", {}, "LoRA adapters"), el("p", { class: "muted" },
      "Per replica: the adapters its engine runs or queues requests for (active), those registered there (held by this gateway or listed by the engine; requests in flight in brackets), their memory against the pool's budget, and what the gateways did there: every gateway process's counts for a shared replica when they share adapter state (state: redis), this process's own since it started otherwise (Counted by)."));
    const holder = el("div", { id: "adapters" });
    page.append(holder);
    every(5000, async () => {
      const doc = await api("GET", "/admin/adapters");
      if (!doc.pools.length) { holder.replaceChildren(el("p", { class: "muted" }, "No pool serves the base model of a LoRA adapter (policies.yaml: kind: adapter).")); return; }
      holder.replaceChildren(...doc.pools.map((pool) => el("div", { class: "card", "data-pool": pool.name },
        el("h2", {}, `${pool.name} `, el("span", { class: "muted" }, pool.model)),
        el("div", { class: "kv" },
          el("span", {}, "adapters ", el("b", {}, String(pool.adapters.length))),
          el("span", {}, "memory budget ", el("b", {}, pool.memory_budget_mb === null ? "none (max_loras only)" : `${fmt.num(pool.memory_budget_mb, 1)} MB`)),
        ),
        table([
          { label: "Replica", key: "id" },
          { label: "State", render: (r) => pill(r.state) },
          { label: "Active", render: (r) => r.active.join(", ") || "–" },
          { label: "Registered", render: adapterNames },
          { label: "Slots", num: true, render: (r) => (r.max_loras === null ? "–" : `${r.adapters.filter((a) => a.running || a.waiting).length}/${r.max_loras}`) },
          { label: "Memory", num: true, render: (r) => `${fmt.num(r.memory_used_mb, 1)}${pool.memory_budget_mb === null ? "" : " / " + fmt.num(pool.memory_budget_mb, 1)} MB` },
          { label: "Loads", num: true, key: "loads" },
          { label: "Preloads", num: true, key: "preloads" },
          { label: "Evictions", num: true, key: "evictions" },
          { label: "Unloads", num: true, key: "unloads" },
          { label: "Failed", num: true, key: "failures" },
          { label: "Counted by", render: (r) => (r.counted_by === "fleet" ? "all gateways" : "this gateway") },
        ], pool.replicas, { id: `adapters-${pool.name}`, idOf: (r) => r.id }),
      )));
    });
  }

  // ------------------------------------------------------------------ predictor
  async function predictorPage() {
    page.append(el("h1", {}, "Predictor accuracy"));
    const holder = el("div", {});
    page.append(holder);
    every(10000, async () => {
      const doc = await api("GET", "/admin/predictor");
      if (!doc.enabled) { holder.replaceChildren(el("p", { class: "muted" }, "The predictor is disabled (predictor.enabled: false).")); return; }
      const rows = [];
      for (const [pool, state] of Object.entries(doc.pools || {})) {
        for (const [target, info] of Object.entries(state.targets || {})) {
          const online = info.online || {};
          rows.push({ pool, target, source: info.source, samples: info.samples, mape: online.mape_pct, coverage: online.p90_coverage,
            total: online.total, age: info.model_age_s, version: state.model_version, factor: state.ttft_recent_factor });
        }
      }
      holder.replaceChildren(el("div", { class: "card" }, table([
        { label: "Pool", key: "pool" },
        { label: "Target", key: "target" },
        { label: "Source", key: "source" },
        { label: "Samples", num: true, render: (r) => fmt.num(r.samples) },
        { label: "Online MAPE", num: true, render: (r) => (r.mape === null || r.mape === undefined ? "–" : r.mape.toFixed(1) + " %") },
        { label: "p90 coverage", num: true, render: (r) => fmt.pct(r.coverage) },
        { label: "Scored", num: true, render: (r) => fmt.num(r.total) },
        { label: "Model age", num: true, render: (r) => (r.age === null || r.age === undefined ? "–" : Math.round(r.age) + " s") },
        { label: "Version", num: true, key: "version" },
        { label: "TTFT factor", num: true, render: (r) => (r.target === "ttft" && r.factor !== undefined ? r.factor.toFixed(3) : null) },
      ], rows, { id: "predictor-table" })));
    });
  }

  // ------------------------------------------------------------------ live tail
  async function tailPage() {
    page.append(el("h1", {}, "Live tail"), el("p", { class: "muted" }, "This replica's newest requests (metadata only; never prompt text)."), teamNote("Requests"));
    const card = el("div", { class: "card" });
    page.append(card);
    every(2000, async () => {
      const doc = await api("GET", "/admin/activity");
      card.replaceChildren(table([
        { label: "Time (UTC)", render: (r) => fmt.time(r.ts) },
        { label: "Request", key: "request_id" },
        { label: "Tenant", key: "tenant" },
        { label: "Key", key: "key_id" },
        { label: "Model", render: (r) => r.requested_model + (r.model && r.model !== r.requested_model ? ` → ${r.model}` : "") },
        { label: "Status", render: (r) => pill(r.status) },
        { label: "HTTP", num: true, key: "http_status" },
        { label: "Reason", key: "reason" },
        { label: "Endpoint", key: "endpoint" },
        { label: "In", num: true, render: (r) => fmt.num(r.input_tokens) },
        { label: "Out", num: true, render: (r) => fmt.num(r.output_tokens) },
        { label: "Cost", num: true, render: (r) => fmt.usd(r.cost_usd) },
        { label: "TTFT", num: true, render: (r) => fmt.ms(r.ttft_ms) },
        { label: "Duration", num: true, render: (r) => fmt.ms(r.duration_ms) },
      ], doc.tail, { id: "tail-table" }));
    });
  }

  // ------------------------------------------------------------------ audit
  // the fields of an object that a change altered, as "field: before → after"
  function changedFields(before, after) {
    const show = (v) => (v === undefined || v === null ? "–" : typeof v === "object" ? JSON.stringify(v) : String(v));
    const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
    const empty = (v) => v === null || v === undefined || (typeof v === "object" && Object.keys(v).length === 0);
    const fields = (obj) => Object.entries(obj).filter(([, v]) => !empty(v)).map(([k, v]) => `${k}: ${show(v)}`);
    if (before === null && after === null) return [];
    if (before === null && isObj(after)) return ["created", ...fields(after)];
    if (after === null && isObj(before)) return ["removed", ...fields(before)];
    if (!isObj(before) || !isObj(after)) return [`${show(before)} → ${show(after)}`];
    const names = [...new Set([...Object.keys(before), ...Object.keys(after)])];
    return names.filter((k) => JSON.stringify(before[k]) !== JSON.stringify(after[k]))
      .map((k) => `${k}: ${show(before[k])} → ${show(after[k])}`);
  }

  async function auditPage() {
    page.append(el("h1", {}, "Audit log"), el("p", { class: "muted" },
      "Every admin change that succeeded on this replica, newest first: who (admin token, console session or loopback), when, what, before → after. Secrets are never recorded."),
      teamNote("Your own changes, and changes of the keys, tenants and overrides"));
    const actor = el("select", { id: "audit-actor" }, ["", "admin-token", "console", "loopback"].map((a) => el("option", { value: a }, a || "anyone")));
    const action = el("input", { id: "audit-action", placeholder: "keys, DELETE, floor…", size: 16 });
    const limit = el("select", { id: "audit-limit" }, ["100", "500", "1000"].map((n) => el("option", { value: n }, n)));
    const go = el("button", { id: "audit-go" }, "Show");
    const card = el("div", { class: "card" });
    page.append(el("div", { class: "toolbar" }, el("label", {}, "Actor", actor), el("label", {}, "Action", action), el("label", {}, "Newest", limit), go), card);
    async function load() {
      const query = new URLSearchParams({ limit: limit.value });
      if (actor.value) query.set("actor", actor.value);
      if (action.value.trim()) query.set("action", action.value.trim());
      const doc = await api("GET", `/admin/audit?${query}`);
      if (!doc.enabled) { card.replaceChildren(el("p", { class: "muted" }, "The audit log is disabled (ledger.audit.enabled: false).")); return; }
      card.replaceChildren(...[doc.data.length ? table([
        { label: "Time (UTC)", render: (r) => fmt.time(r.time) },
        { label: "Actor", render: (r) => el("code", { class: "nowrap" }, r.actor) },
        { label: "Action", key: "action" },
        { label: "Target", key: "target" },
        { label: "Status", num: true, key: "status" },
        { label: "Client", key: "client" },
        { label: "Before → after", render: (r) => el("div", { class: "changes" }, changedFields(r.before, r.after).map((line) => el("div", {}, line))) },
      ], doc.data, { id: "audit-table" }) : el("p", { class: "muted" }, "No change recorded yet."),
      doc.has_more ? el("p", { class: "muted" }, "Older changes exist: narrow the filter or ask for more.") : null].filter(Boolean));
    }
    go.addEventListener("click", () => load().catch((e) => { if (!quiet(e)) card.replaceChildren(errorBox(e)); }));
    await load();
  }

  // ------------------------------------------------------------------ programs (agent runs)
  // Live agent runs and what each spent (GET /admin/programs, docs/console.md): read from the runs' own
  // counters (in Redis, every replica's), the newest runs only; a team admin gets its teams' runs.
  function capLine(c) {
    const usd = c.dimension === "usd_per_run";
    const show = (v) => (usd ? fmt.usd(v) : fmt.num(v));
    return el("div", { class: "nowrap", "data-dimension": c.dimension }, `${c.dimension}: ${show(c.remaining)} left of ${show(c.limit)}${c.shadow ? " (shadow)" : ""}`);
  }

  async function programsPage() {
    page.append(el("h1", {}, "Programs"), el("p", { class: "muted" },
      "Live agent runs (programs): calls, tokens and dollars so far, when the run started, and, for a run that a run rule counts, its wall-clock cap and what each cap has left. A run no rule counts is summed from the ledger (this month, up to 30 s old). Program ids are shown as stored (a long one as its hash)."));
    const tenant = el("input", { id: "programs-tenant", type: "search", placeholder: "any tenant", size: 14 });
    const sort = el("select", { id: "programs-sort" }, [["spend", "top spend"], ["recent", "last call"]].map(([v, t]) => el("option", { value: v }, t)));
    const limit = el("select", { id: "programs-limit" }, ["50", "100", "200"].map((n) => el("option", { value: n }, n)));
    const card = el("div", { class: "card" });
    page.append(el("div", { class: "toolbar" }, el("label", {}, "Tenant", tenant), el("label", {}, "Order", sort), el("label", {}, "Show", limit)), card);
    async function load() {
      const query = new URLSearchParams({ sort: sort.value, limit: limit.value });
      if (tenant.value.trim()) query.set("tenant", tenant.value.trim());
      const doc = await api("GET", `/admin/programs?${query}`);
      card.replaceChildren(doc.data.length ? table([
        { label: "Tenant", key: "tenant" },
        { label: "Program", render: (r) => el("code", { class: "nowrap" }, r.program) },
        { label: "Key", key: "key_id" },
        { label: "Model", key: "model" },
        { label: "Calls", num: true, render: (r) => fmt.num(r.calls) },
        { label: "Tokens", num: true, render: (r) => fmt.num(r.tokens) },
        { label: "Spent", num: true, render: (r) => fmt.usd(r.spent_usd) },
        { label: "Started (UTC)", render: (r) => fmt.time(r.started_at) },
        { label: "Seconds left", num: true, render: (r) => fmt.num(r.seconds_left) },
        { label: "Caps left", render: (r) => (r.caps.length ? el("div", {}, r.caps.map(capLine)) : el("span", { class: "muted" }, r.source === "ledger" ? "no run rule (ledger)" : "–")) },
        { label: "Last call (UTC)", render: (r) => fmt.time(r.last_seen) },
      ], doc.data, { id: "programs-table", idOf: (r) => `${r.tenant}/${r.program}` })
        : el("p", { class: "muted" }, "No agent run has called lately."));
    }
    for (const input of [tenant, sort, limit]) input.addEventListener("change", guard(load));
    every(5000, load);
  }

  // ------------------------------------------------------------------ routing and login
  const PAGES = { overview, keys, tenants: tenantsPage, usage: usagePage, limits: limitsPage, pools: poolsPage, adapters: adaptersPage, programs: programsPage, predictor: predictorPage, tail: tailPage, audit: auditPage };

  async function route() {
    const name = (location.hash || "#overview").slice(1);
    const render = PAGES[name] || overview;
    clearPage();
    for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.getAttribute("href") === `#${name}`);
    page.dataset.page = name;
    const gen = pageGen;
    try { await render(); } catch (e) { if (!quiet(e)) page.append(errorBox(e)); }
    if (gen === pageGen) page.dataset.ready = name;
  }

  function showLogin() {
    clearPage();
    $("nav").hidden = true;
    $("logout").hidden = true;
    $("whoami").hidden = true;
    $("login").hidden = false;
    $("token").focus();
  }

  function showConsole(who) {
    identity = who || { role: "admin", teams: [] };
    const teams = identity.role === "team_admin" ? ` of ${identity.teams.join(", ")}` : "";
    $("whoami").textContent = `${identity.actor || "admin"} · ${identity.role.replace("_", " ")}${teams}`;
    $("whoami").dataset.role = identity.role;
    $("whoami").hidden = false;
    $("login").hidden = true;
    $("nav").hidden = false;
    $("logout").hidden = false;
    route();
  }

  $("login-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    $("login-error").textContent = "";
    const response = await fetch("/ui/login", {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ token: $("token").value }),
    });
    $("token").value = "";
    if (response.ok) { const doc = await response.json(); csrfToken = doc.csrf_token || ""; showConsole(doc.identity); }
    else $("login-error").textContent = ((await response.json()).error || {}).message || "login failed";
  });

  $("logout").addEventListener("click", async () => {
    await fetch("/ui/logout", { method: "POST", credentials: "same-origin" });
    csrfToken = "";
    showLogin();
  });

  window.addEventListener("hashchange", () => { if ($("login").hidden) route(); });

  (async () => {
    const session = await (await fetch("/ui/session", { credentials: "same-origin" })).json();
    if (!session.token_required) $("login-note").textContent = "No admin token is configured: the console answers loopback callers only. Log in with an empty token.";
    csrfToken = session.csrf_token || "";
    if (session.oidc) { $("oidc-login").hidden = false; $("oidc-login").textContent = session.oidc; }
    if (session.authenticated) showConsole(session.identity); else showLogin();
  })();
})();
