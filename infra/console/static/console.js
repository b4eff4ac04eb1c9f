// Draw every figure a page embeds as JSON data (<script type="application/json">): no inline script runs.
document.querySelectorAll("[data-figure]").forEach(function (div) {
  var source = document.getElementById(div.dataset.figure);
  if (!source || typeof Plotly === "undefined") { return; }
  var fig = JSON.parse(source.textContent);
  Plotly.newPlot(div, fig.data, fig.layout, {displaylogo: false, responsive: true});
});
