// The page's table of contents (right column) shows API names such as
// COMPONENT_LAYER_RANGES or grafting_lens.study.run_directory in a narrow column. A name
// too long for it may break after an underscore or a dot, never inside a word
// ("COMPONENT_LAYER_RANG|ES"): CSS has no such rule, so this inserts the break points.
function markNameBreaks() {
  for (const label of document.querySelectorAll(".md-nav--secondary .md-ellipsis")) {
    if (label.dataset.glBreaks) continue;
    label.dataset.glBreaks = "1";
    for (const node of Array.from(label.childNodes)) {
      if (node.nodeType !== Node.TEXT_NODE || !/[_.]/.test(node.textContent)) continue;
      const parts = node.textContent.split(/(?<=[_.])/);
      const fragment = document.createDocumentFragment();
      parts.forEach((part, index) => {
        fragment.append(part);
        if (index < parts.length - 1) fragment.append(document.createElement("wbr"));
      });
      label.replaceChild(fragment, node);
    }
  }
}
if (typeof document$ !== "undefined") {
  document$.subscribe(markNameBreaks); // Material's instant navigation
} else {
  document.addEventListener("DOMContentLoaded", markNameBreaks);
}
