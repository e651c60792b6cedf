// Short inline code (an option such as `--unembed` or `--prompts FILE`, a name such as
// `top5_low`) never breaks across lines: a browser may break after a hyphen, which would
// show "--" at one line's end and "unembed" at the next. Longer code (a command, an error
// message) still wraps at its spaces. CSS cannot tell the two apart, so this marks them.
function markShortCode() {
  for (const code of document.querySelectorAll(".md-typeset :not(pre) > code")) {
    const text = code.textContent;
    const short = text.length <= 20 || (text.length <= 40 && !/\s/.test(text));
    if (short) code.classList.add("gl-nowrap");
  }
}
if (typeof document$ !== "undefined") {
  document$.subscribe(markShortCode); // Material's instant navigation
} else {
  document.addEventListener("DOMContentLoaded", markShortCode);
}
