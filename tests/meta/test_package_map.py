"""docs/package.md, the picture of our Muon package, is the one tools/package_map.py draws now.

The page is generated from the imports (``make docs``); this test regenerates it and fails, naming
the command, when the committed page differs. Negative controls on a copy of the checkout: an
added import, a lazy one, one that closes a circle and a patch's import each change the picture;
an import of an upstream module that is not drawn does not.
"""

import importlib.util
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("package_map", ROOT / "tools/package_map.py")
package_map = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(package_map)


def test_the_committed_page_is_the_drawn_one():
    page = ROOT / package_map.PAGE
    assert page.read_text() == package_map.render(ROOT), (
        f"{package_map.PAGE} is stale: run {package_map.COMMAND}"
    )


def test_every_arrow_joins_drawn_nodes():
    # Mermaid draws an undeclared id as a bare box: an arrow to a misnamed node would pass unseen
    graph = package_map.render(ROOT).split("```mermaid\n")[1].split("```")[0]
    declared = set(re.findall(r"^\s*(\w+)\[\"", graph, flags=re.M))
    arrows = re.findall(r"^  (\w+) (?:-->|-\.->|-- \"[\d, ]+\" -->) (\w+)$", graph, flags=re.M)
    assert len(declared) >= 25 and len(arrows) >= 40, (len(declared), len(arrows))
    assert {end for arrow in arrows for end in arrow} <= declared
    lines = [line for line in graph.splitlines() if "-->" in line or "-.->" in line]
    assert len(lines) == len(arrows), "every arrow line has one of the three forms"


def test_no_import_circle():
    assert package_map.analyse(ROOT)["circles"] == []


def _copy(tmp_path: Path) -> Path:
    for rel in (package_map.OPT, "patches"):
        shutil.copytree(ROOT / rel, tmp_path / rel)
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools/fork.py", tmp_path / "tools/fork.py")
    return tmp_path


def _append(root: Path, module: str, text: str):
    path = root / package_map.OPT / module
    path.write_text(path.read_text() + text)


def test_a_changed_import_changes_the_picture(tmp_path):
    root = _copy(tmp_path)
    before = package_map.render(root)
    assert before == package_map.render(ROOT), "the copy draws as the checkout"
    assert "megatron_muon_config --> repairs_group_matching" not in before

    _append(root, "megatron_muon/config.py", "\nfrom ..repairs import group_matching\n")
    _append(root, "qk_clip.py", "\ndef _f():\n    from .megatron_muon import tp\n")
    _append(
        root, "repairs/group_matching.py", "\nfrom megatron.core.optimizer.clip_grads import x\n"
    )
    after = package_map.render(root)
    assert "megatron_muon_config --> repairs_group_matching" in after  # module level: solid
    assert "qk_clip -.-> megatron_muon_tp" in after  # inside a function: dotted
    assert len(after.splitlines()) == len(before.splitlines()) + 2, "clip_grads: no arrow"
    assert package_map.analyse(root)["circles"] == []

    _append(root, "megatron_muon/config.py", "\nfrom .newton_schulz import X\n")
    circles = package_map.analyse(root)["circles"]
    assert circles == [
        [f"{package_map.PACKAGE}.megatron_muon.{m}" for m in ("config", "newton_schulz")]
    ]
    assert "Import circles: 1 (megatron_muon.config -> megatron_muon.newton_schulz)" in (
        package_map.render(root)
    )


def test_a_patch_import_draws_an_upstream_arrow(tmp_path):
    root = _copy(tmp_path)
    arrow = 'up_megatron_core_optimizer_optimizer -- "0021" --> repairs_chained_grad_scaler'
    assert arrow in package_map.render(root)
    patch = next((root / "patches").glob("0021-*.patch"))
    text = patch.read_text()
    line = "+from .repairs.chained_grad_scaler import prepare_grads_with_one_scale\n"
    assert line in text
    patch.write_text(
        text.replace(line, "+from .repairs import chained_grad_scaler, group_matching\n")
    )
    after = package_map.render(root)
    assert arrow in after
    assert 'up_megatron_core_optimizer_optimizer -- "0021" --> repairs_group_matching' in after
    patch.write_text(text.replace(line, "+\n"))
    assert arrow not in package_map.render(root)
