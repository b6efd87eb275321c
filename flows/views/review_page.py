"""The review page: one HTML document whose script talks to the review server's API (flows/views/review_app.py).

The page is flows/views/pages.py's shell: every text the server sends is escaped there (an episode's HTML is the
inspect views' own, `inspect_render.episode_body`) or set as text here (`textContent`, never markup), and the
Content-Security-Policy runs only this script and lets it call only the server it came from. When the first episode
is shown the script marks `<html data-ready="1">`; each label saved adds one to `<body data-saves>`, and a refused
one sets `data-error` to the server's message: what the browser test reads back. (A grade counts once the next
episode is shown, so a key pressed after it applies to that one.)

Keyboard (outside text fields): j / k next and previous episode, g good (1), b bad (0), 1-5 a score of 0, .25, .5,
.75 or 1, Enter saves the score field, n writes a note (sent with the next label), o orders the episode's group (then
up / down choose, Shift+up / down move, Enter saves, Esc closes; or drag the rows), ? shows the keys.
"""

from __future__ import annotations

from flows.views.pages import esc, page

KEYS = [("j / k", "next / previous episode"), ("g", "good: grade 1, then the next episode"),
        ("b", "bad: grade 0, then the next episode"), ("1 – 5", "grade 0, 0.25, 0.5, 0.75 or 1, then the next"),
        ("Enter", "save the score typed in the score field"), ("n", "write a note (sent with the next label)"),
        ("o", "order this episode's group"), ("↑ / ↓", "(ordering) choose a row"),
        ("Shift + ↑ / ↓", "(ordering) move the chosen row; or drag rows with the mouse"),
        ("Enter / Esc", "(ordering) save / close"), ("?", "show or hide these keys")]

CSS = """
body{max-width:none;margin:0;padding:0}
header{display:flex;gap:1rem;align-items:center;padding:.5rem 1rem;border-bottom:1px solid #ddd;flex-wrap:wrap}
header h1{font-size:1.1rem;margin:0}#status{color:#15803d}#status.error{color:#b91c1c}
.layout{display:grid;grid-template-columns:24rem 1fr;height:calc(100vh - 3.2rem)}
#queue{list-style:none;margin:0;padding:0;overflow-y:auto;border-right:1px solid #ddd}
#queue li{padding:.3rem .6rem;border-bottom:1px solid #eee;cursor:pointer}#queue li.active{background:#dbeafe}
#queue li.graded .meta,#queue li.ordered .meta{color:#15803d}.answer{font:12px ui-monospace,monospace;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
main{overflow-y:auto;padding:.6rem 1rem}.controls{display:flex;gap:.4rem;flex-wrap:wrap;align-items:center;margin:.4rem 0}
button{padding:.25rem .7rem}#score{width:5rem}#note{flex:1;min-width:12rem}
#group-panel{position:fixed;right:1rem;top:4rem;width:32rem;background:#fff;border:2px solid #2563eb;border-radius:6px;padding:.6rem;box-shadow:0 4px 16px #0003}
#order-list{padding-left:1.6rem}#order-list li{padding:.35rem .5rem;margin:.2rem 0;border:1px solid #ccc;border-radius:4px;background:#fafafa;cursor:grab;user-select:none}
#order-list li.chosen{border-color:#2563eb;background:#dbeafe}#order-list li.dragging{opacity:.5}
#help{position:fixed;left:30%;top:5rem;background:#fff;border:1px solid #999;padding:1rem;box-shadow:0 4px 16px #0003}
.mine{font-weight:600}.truth{color:#555}
"""

SCRIPT = r"""
window.addEventListener('error', function (e) { document.documentElement.dataset.jsError = String(e.message); });
(function () {
'use strict';
var $ = function (id) { return document.getElementById(id); };
var S = {info: null, busy: false, queue: [], pos: -1, labels: {grades: {}, orders: {}}, episode: null, saves: 0,
         order: [], chosen: 0, drag: null};

// -- the server ------------------------------------------------------------------------------
function api(method, path, body) {
  var o = {method: method, headers: {'Accept': 'application/json'}, credentials: 'same-origin'};
  if (body !== undefined) { o.headers['Content-Type'] = 'application/json'; o.body = JSON.stringify(body); }
  return fetch(path, o).then(function (r) {
    return r.json().then(function (d) { if (!r.ok) throw new Error(d && d.error || ('HTTP ' + r.status)); return d; });
  });
}
function status(text, error) {
  var s = $('status'); s.textContent = text; s.className = error ? 'error' : '';
  if (error) document.documentElement.dataset.error = text;
}
function fail(e) { status(String(e.message || e), true); }
// One label in flight at a time: a key pressed meanwhile is ignored, not applied to the wrong episode.
function busy(p) {
  S.busy = true;
  return p.then(function () { S.busy = false; }, function (e) { S.busy = false; fail(e); });
}
function reviewer() { return $('reviewer').value.trim(); }
function fmt(v) { return v === null || v === undefined ? '–' : String(Math.round(v * 1000) / 1000); }
function groupKey(b, g) { return b + '/' + g; }
function item(id) { return S.queue.find(function (x) { return x.rollout_id === id; }) || null; }
function ordered(it) {
  var o = S.labels.orders[groupKey(it.batch_id, it.group_id)];
  return !!o && o.indexOf(it.rollout_id) >= 0;
}
function loadLabels() {
  return api('GET', '/api/labels?reviewer=' + encodeURIComponent(reviewer())).then(function (l) { S.labels = l; });
}

// -- the queue and the episode (model text is set as text, or is the server's escaped HTML) ----
function loadQueue() {
  var q = '/api/queue?order=' + encodeURIComponent($('order').value) + '&reviewer=' + encodeURIComponent(reviewer());
  if ($('reward').value) q += '&reward=' + encodeURIComponent($('reward').value);
  return api('GET', q).then(function (items) { S.queue = items; renderQueue(); });
}
function renderQueue() {
  var ol = $('queue');
  ol.textContent = '';
  S.queue.forEach(function (it, i) {
    var li = document.createElement('li'), g = S.labels.grades[it.rollout_id], o = ordered(it);
    li.className = 'item' + (i === S.pos ? ' active' : '') + (g ? ' graded' : '') + (o ? ' ordered' : '');
    li.dataset.rolloutId = it.rollout_id;
    if (g) li.dataset.mine = g.value;
    var m = document.createElement('div');
    m.className = 'meta';
    m.textContent = (it.step === null ? it.split : 'step ' + it.step) + ' · ' + it.group_id.slice(-12) + ' · #' +
      it.sample_idx + (it.key !== null ? ' · ' + fmt(it.key) : '') + (g ? ' · ✓ ' + fmt(g.value) : '') +
      (o ? ' · ordered' : '');
    var a = document.createElement('div');
    a.className = 'answer';
    a.textContent = it.answer;
    li.appendChild(m); li.appendChild(a);
    li.addEventListener('click', function () { show(i); });
    ol.appendChild(li);
  });
}
function show(i) {
  if (i < 0 || i >= S.queue.length) return Promise.resolve();
  S.pos = i;
  return api('GET', '/api/episodes/' + encodeURIComponent(S.queue[i].rollout_id)).then(function (ep) {
    S.episode = ep;
    $('episode').dataset.rolloutId = ep.rollout_id;
    $('title').textContent = ep.rollout_id + ' · ' + (ep.step === null ? ep.split : 'step ' + ep.step) + ' · group ' +
      ep.group_id + ' · sample ' + ep.sample_idx;
    $('truth').textContent = 'task data: ' + JSON.stringify(ep.metadata);
    $('episode-body').innerHTML = ep.html;  // escaped by the server (inspect_render.episode_body)
    mine();
    renderQueue();
    var a = document.querySelector('#queue li.active');
    if (a) a.scrollIntoView({block: 'nearest'});
    document.documentElement.dataset.ready = '1';
  });
}
function mine() {
  var ep = S.episode, g = ep && S.labels.grades[ep.rollout_id], o = ep && S.labels.orders[groupKey(ep.batch_id, ep.group_id)];
  $('mine').textContent = !ep ? '' : 'your grade: ' + (g ? fmt(g.value) + (g.note ? ' (' + g.note + ')' : '') : 'none') +
    (o ? ' · group ordered: #' + (o.indexOf(ep.rollout_id) + 1) + ' of ' + o.length : '');
}
function saved(r) {
  S.saves += 1;
  document.body.dataset.saves = S.saves;
  $('note').value = '';
  delete document.documentElement.dataset.error;
  status('saved ' + r.kind + ' (' + r.submission_id + ')');
}

// -- grading: then the next episode ------------------------------------------------------------
function grade(v) {
  var ep = S.episode, note = $('note').value || null;
  if (!ep || S.busy) return;
  busy(api('POST', '/api/labels', {kind: 'grade', workspace_id: S.info.workspace_id, reviewer: reviewer(),
                                   rollout_id: ep.rollout_id, value: v, note: note}).then(function (r) {
    S.labels.grades[ep.rollout_id] = {value: v, note: note};
    return show(Math.min(S.pos + 1, S.queue.length - 1)).then(function () { saved(r); });
  }));
}
function typedScore() {
  var box = $('score'), v = box.value;
  box.blur();  // the keys work again
  box.value = '';
  if (v !== '') grade(parseFloat(v));
}

// -- ordering the group: keys, buttons, or dragging rows (mouse events, no HTML drag-and-drop) ----
function openOrder() {
  var ep = S.episode;
  if (!ep) return;
  var had = S.labels.orders[groupKey(ep.batch_id, ep.group_id)] || [];  // the saved order first, then the rest
  S.order = had.filter(function (r) { return ep.group.indexOf(r) >= 0; })
    .concat(ep.group.filter(function (r) { return had.indexOf(r) < 0; }));
  S.chosen = Math.max(0, S.order.indexOf(ep.rollout_id));
  $('group-panel').hidden = false;
  renderOrder();
}
function closeOrder() { $('group-panel').hidden = true; }
function renderOrder() {
  var ol = $('order-list');
  ol.textContent = '';
  S.order.forEach(function (id, i) {
    var li = document.createElement('li'), it = item(id);
    li.dataset.rolloutId = id;
    li.className = (i === S.chosen ? 'chosen' : '') + (S.drag === id ? ' dragging' : '');
    li.textContent = (it ? '#' + it.sample_idx + ' ' + (it.answer || '(no answer)') : id) +
      (S.episode && id === S.episode.rollout_id ? '  ← this episode' : '');
    ol.appendChild(li);
  });
}
function move(d) {
  var j = S.chosen + d;
  if (j < 0 || j >= S.order.length) return;
  var x = S.order[S.chosen]; S.order[S.chosen] = S.order[j]; S.order[j] = x;
  S.chosen = j;
  renderOrder();
}
function choose(d) { S.chosen = Math.min(Math.max(S.chosen + d, 0), S.order.length - 1); renderOrder(); }
function saveOrder() {
  var ep = S.episode, order = S.order.slice();
  if (S.busy) return;
  busy(api('POST', '/api/labels', {kind: 'order', workspace_id: S.info.workspace_id, reviewer: reviewer(),
                                   order: order, note: $('note').value || null}).then(function (r) {
    S.labels.orders[groupKey(ep.batch_id, ep.group_id)] = order;
    closeOrder(); mine(); renderQueue(); saved(r);
  }));
}
$('order-list').addEventListener('mousedown', function (e) {
  var li = e.target.closest('li');
  if (!li) return;
  e.preventDefault();
  S.drag = li.dataset.rolloutId;
  S.chosen = S.order.indexOf(S.drag);
  renderOrder();
});
document.addEventListener('mousemove', function (e) {
  if (!S.drag) return;
  var over = document.elementFromPoint(e.clientX, e.clientY), li = over && over.closest && over.closest('#order-list li');
  if (!li || li.dataset.rolloutId === S.drag) return;
  var from = S.order.indexOf(S.drag), to = S.order.indexOf(li.dataset.rolloutId);
  S.order.splice(from, 1);
  S.order.splice(to, 0, S.drag);
  S.chosen = to;
  renderOrder();
});
document.addEventListener('mouseup', function () { if (S.drag) { S.drag = null; renderOrder(); } });

// -- keys ----------------------------------------------------------------------------------------
var GRADES = {g: 1, b: 0, '1': 0, '2': 0.25, '3': 0.5, '4': 0.75, '5': 1};
document.addEventListener('keydown', function (e) {
  var t = e.target, typing = t && (t.tagName === 'INPUT' || t.tagName === 'SELECT' || t.tagName === 'TEXTAREA');
  if (e.key === 'Escape') { if (typing) t.blur(); closeOrder(); $('help').hidden = true; return; }
  if (typing) { if (e.key === 'Enter' && t.id === 'score') { e.preventDefault(); typedScore(); } return; }
  if (e.ctrlKey || e.metaKey || e.altKey) return;
  var step = {ArrowUp: -1, ArrowDown: 1}[e.key];
  if (!$('group-panel').hidden) {
    if (step) { e.preventDefault(); if (e.shiftKey) move(step); else choose(step); }
    else if (e.key === 'Enter') { e.preventDefault(); saveOrder(); }
    return;
  }
  if (e.key in GRADES) { e.preventDefault(); grade(GRADES[e.key]); }
  else if (e.key === 'j' || e.key === 'k' || step) {
    e.preventDefault();
    show(S.pos + (e.key === 'k' || step === -1 ? -1 : 1)).catch(fail);
  }
  else if (e.key === 'Enter') { e.preventDefault(); typedScore(); }
  else if (e.key === 'n') { e.preventDefault(); $('note').focus(); }
  else if (e.key === 'o') { e.preventDefault(); openOrder(); }
  else if (e.key === '?') { $('help').hidden = !$('help').hidden; }
});

// -- buttons, selectors, and the start ------------------------------------------------------------
function toggleHelp() { $('help').hidden = !$('help').hidden; }
$('good').addEventListener('click', function () { grade(1); });
$('bad').addEventListener('click', function () { grade(0); });
$('save-score').addEventListener('click', typedScore);
$('order-group').addEventListener('click', openOrder);
$('save-order').addEventListener('click', saveOrder);
$('close-order').addEventListener('click', closeOrder);
$('help-button').addEventListener('click', toggleHelp);
$('up').addEventListener('click', function () { move(-1); });
$('down').addEventListener('click', function () { move(1); });
function reload() {  // the queue again (another order, reward or reviewer), staying on the episode shown
  var id = S.episode && S.episode.rollout_id;
  return loadQueue().then(function () {
    var i = S.queue.findIndex(function (x) { return x.rollout_id === id; });
    return show(i >= 0 ? i : 0);
  });
}
$('order').addEventListener('change', function () { reload().catch(fail); });
$('reward').addEventListener('change', function () {
  if ($('order').value === 'high' || $('order').value === 'low') reload().catch(fail);
});
$('reviewer').addEventListener('change', function () {
  localStorage.setItem('rlops-reviewer', reviewer());
  loadLabels().then(reload).catch(fail);
});
api('GET', '/api/info').then(function (info) {
  S.info = info;
  info.rewards.forEach(function (r) {
    var o = document.createElement('option'); o.value = r; o.textContent = r; $('reward').appendChild(o);
  });
  if (info.default_reward) $('reward').value = info.default_reward;
  var d = $('order').querySelector('option[value=disagreement]');
  if (info.judge && info.programmatic) d.textContent = 'disagreements first (' + info.judge + ' vs ' + info.programmatic + ')';
  else d.disabled = true;
  $('reviewer').value = localStorage.getItem('rlops-reviewer') || info.reviewer || '';
  return loadLabels();
}).then(loadQueue).then(function () {  // start at the first episode without a label of this reviewer's
  var first = S.queue.findIndex(function (x) { return !S.labels.grades[x.rollout_id] && !ordered(x); });
  return show(first >= 0 ? first : 0);
}).catch(fail);
})();
"""


def review_page(run: str) -> str:
    """The review page of `run` (its data comes from the API once the script runs)."""
    keys = "".join(f"<tr><td><kbd>{esc(k)}</kbd></td><td>{esc(what)}</td></tr>" for k, what in KEYS)
    body = (f"<header><h1>Review {esc(run)}</h1>"
            "<label>reviewer <input id='reviewer' size='12' placeholder='your name'></label>"
            "<label>queue <select id='order'><option value='step'>by step</option>"
            "<option value='high'>by reward, highest first</option><option value='low'>by reward, lowest first</option>"
            "<option value='disagreement'>disagreements first</option></select></label>"
            "<label>reward <select id='reward'></select></label>"
            "<button id='help-button' title='keyboard shortcuts (?)'>keys ?</button><span id='status'></span></header>"
            "<div class='layout'><ol id='queue'></ol><main id='episode'><h2 id='title'></h2>"
            "<div class='controls'><button id='good' title='g'>Good (g)</button><button id='bad' title='b'>Bad (b)</button>"
            "<input id='score' type='number' min='0' max='1' step='0.05' placeholder='0 – 1'>"
            "<button id='save-score' title='Enter'>Save score</button>"
            "<input id='note' placeholder='note, sent with the next label (n)'>"
            "<button id='order-group' title='o'>Order group (o)</button></div>"
            "<div id='mine' class='mine'></div><div id='truth' class='truth meta'></div><div id='episode-body'></div></main></div>"
            "<section id='group-panel' hidden><h2>Order this group, best first</h2>"
            "<p class='meta'>Drag the rows, or ↑ / ↓ to choose and Shift + ↑ / ↓ to move; Enter saves, Esc closes.</p>"
            "<ol id='order-list'></ol><button id='up'>Move up</button><button id='down'>Move down</button> "
            "<button id='save-order'>Save order (Enter)</button><button id='close-order'>Close (Esc)</button></section>"
            f"<div id='help' hidden><h2>Keys</h2><table>{keys}</table></div>")
    return page(f"review {run}", body, script=SCRIPT, css=CSS, connect=True)
