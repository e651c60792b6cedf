"""mkdocs hooks: plotly.js once for the whole site.

Every figure on the site (the tutorials' outputs, getting started's) needs plotly.js,
4.6 MB. Embedded in each page, as a notebook embeds it, every tutorial page weighs over
5 MB; here the installed plotly's own ``plotly.min.js`` becomes one file of the site, which
every page loads in its head (a figure's inline script calls ``Plotly`` as the page is
read) and a browser caches, and the copy each notebook embeds is taken out of its page.
"""

from __future__ import annotations

import re
from pathlib import Path

import plotly
from mkdocs.structure.files import File
from mkdocs.utils import get_relative_url

PLOTLY_JS = "javascripts/plotly.min.js"

# The script a notebook's plotly renderer embeds: plotly.js itself, minified, whose first
# line names it ("/** plotly.js v3.1.0 ...").
_EMBEDDED = re.compile(r"<script[^>]*>\s*/\*\*?\s*\*?\s*plotly\.js v[\d.]+.*?</script>", re.S)


def on_files(files, config):
    source = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    files.append(File.generated(config, PLOTLY_JS, abs_src_path=str(source)))
    return files


def on_post_page(output: str, page, config) -> str:
    script = f'<script src="{get_relative_url(PLOTLY_JS, page.url)}"></script>'
    return _EMBEDDED.sub("", output).replace("</head>", f"{script}\n</head>", 1)
