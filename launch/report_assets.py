"""The style sheet and the script of the run's page (launch/report.py), inlined into it so
the page is one file that opens anywhere without a network."""

CSS = """
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "DejaVu Sans", sans-serif;
       color: #1d232b; background: #f4f6f9; }
header { background: #1e3a5f; color: #fff; padding: 14px 28px; display: flex;
         align-items: baseline; gap: 18px; }
header h1 { margin: 0; font-size: 20px; font-weight: 600; }
header .where { opacity: 0.75; font-size: 12px; font-family: monospace; }
main { max-width: 1200px; margin: 0 auto; padding: 8px 24px 24px; }
section { background: #fff; border: 1px solid #dde3ea; border-radius: 8px; margin: 16px 0;
          padding: 12px 20px 16px; }
h2 { font-size: 16px; margin: 4px 0 12px; color: #1e3a5f; }
h3 { font-size: 14px; margin: 4px 0 8px; }
h4 { font-size: 12px; margin: 8px 0 4px; color: #56606b; text-transform: uppercase; }
.facts { display: grid; grid-template-columns: repeat(auto-fill, minmax(250px, 1fr));
         gap: 10px; }
.fact { background: #eef3f8; border-radius: 6px; padding: 8px 12px; }
.fact .k { font-size: 12px; color: #56606b; }
.fact .v { font-size: 15px; font-weight: 600; word-break: break-word; }
table { border-collapse: collapse; }
#eval table td, #eval table th { border: 1px solid #dde3ea; padding: 4px 10px; }
#eval table th { background: #eef3f8; text-align: left; }
#eval table tr td:not(:first-child) { font-variant-numeric: tabular-nums; }
.chart svg { width: 100%; height: auto; }
.cms { display: flex; flex-wrap: wrap; gap: 28px; }
table.confusion th, table.confusion td { border: 1px solid #dde3ea; padding: 6px 10px;
                                         text-align: center; font-size: 13px; }
table.confusion th { background: #eef3f8; font-weight: 600; }
.note { color: #56606b; font-style: italic; }
.controls { display: flex; gap: 10px; align-items: center; margin-bottom: 10px; }
.controls select, .controls input { padding: 4px 8px; border: 1px solid #c3ccd6;
                                    border-radius: 4px; font: inherit; }
.controls .count { color: #56606b; margin-left: auto; }
details.rollout { border: 1px solid #dde3ea; border-radius: 6px; margin: 6px 0;
                  background: #fbfcfd; }
details.rollout > summary { cursor: pointer; padding: 6px 10px; }
details.rollout .body { padding: 0 12px 10px; }
details.rollout .cols { display: grid; grid-template-columns: 1fr 1fr; gap: 14px; }
details.rollout pre { white-space: pre-wrap; word-break: break-word; background: #f1f3f6;
                      padding: 8px; border-radius: 4px; max-height: 320px; overflow: auto;
                      font-size: 12px; margin: 0; }
.gold { color: #56606b; }
.badge { display: inline-block; min-width: 56px; text-align: center; border-radius: 10px;
         padding: 0 8px; font-size: 12px; color: #fff; }
.badge.exact { background: #2e7d32; }
.badge.valid { background: #1f77b4; }
.badge.invalid { background: #c62828; }
.err { color: #c62828; }
table.terms td { padding: 1px 10px 1px 0; font-size: 12px; }
footer { text-align: center; color: #8a939c; font-size: 12px; padding: 12px; }
"""

SCRIPT = """
(function () {
  var items = Array.prototype.slice.call(document.querySelectorAll("details.rollout"));
  var step = document.getElementById("f-step");
  var verdict = document.getElementById("f-verdict");
  var text = document.getElementById("f-text");
  var shown = document.getElementById("shown");
  function apply() {
    var n = 0, s = step ? step.value : "", v = verdict ? verdict.value : "";
    var t = text ? text.value.toLowerCase() : "";
    items.forEach(function (el) {
      var ok = (!s || el.dataset.step === s)
        && (!v || el.dataset.verdict === v || (v === "valid" && el.dataset.verdict === "exact"))
        && (!t || el.textContent.toLowerCase().indexOf(t) >= 0);
      el.style.display = ok ? "" : "none";
      if (ok) { n += 1; }
    });
    if (shown) { shown.textContent = String(n); }
  }
  [step, verdict, text].forEach(function (el) {
    if (el) { el.addEventListener("input", apply); el.addEventListener("change", apply); }
  });
  // report.html#step=3&verdict=invalid&q=cart opens with those filters (a link to share)
  new URLSearchParams(location.hash.slice(1)).forEach(function (value, key) {
    var el = {step: step, verdict: verdict, q: text}[key];
    if (el) { el.value = value; }
  });
  if (items.length) { items[0].open = true; }
  apply();
  document.body.setAttribute("data-ready", String(items.length));
})();
"""
