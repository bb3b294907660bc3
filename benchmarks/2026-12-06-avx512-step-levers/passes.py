"""Levers as Inductor passes (measured, not kept): Merge (pre-grad) puts sibling F.linear calls on one input into
one linear over concatenated weights, then splits; Unfuse (post-grad) turns addmm(bias, x, w) into mm + bias add."""
import collections, operator, torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass
LINEAR = (torch._C._nn.linear, F.linear)
STATS = collections.Counter()
def _arg(n, i, name):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name)
def merge(g):
    groups = collections.defaultdict(list)
    for n in g.nodes:
        if n.op == "call_function" and n.target in LINEAR:
            groups[n.args[0]].append(n)
    for x, nodes in groups.items():
        if len(nodes) < 2: continue
        ws = [_arg(n, 1, "weight") for n in nodes]; bs = [_arg(n, 2, "bias") for n in nodes]
        if not all(isinstance(w, torch.fx.Node) and w.op in ("placeholder", "get_attr") for w in ws): STATS["skip-w"] += 1; continue
        if not (all(b is None for b in bs) or all(isinstance(b, torch.fx.Node) and b.op in ("placeholder", "get_attr") for b in bs)): STATS["skip-b"] += 1; continue
        vals = [w.meta.get("example_value") for w in ws]
        if any(v is None or v.dim() != 2 for v in vals) or len({(v.shape[1], v.dtype) for v in vals}) != 1: STATS["skip-shape"] += 1; continue
        sizes = [v.shape[0] for v in vals]
        first = nodes[0]
        with g.inserting_before(first):
            wc = g.call_function(torch.cat, (ws, 0))
            bc = g.call_function(torch.cat, (bs, 0)) if bs[0] is not None else None
            y = g.call_function(torch._C._nn.linear, (x, wc, bc))
            parts = g.call_function(torch.split, (y, sizes, -1))
            outs = [g.call_function(operator.getitem, (parts, i)) for i in range(len(nodes))]
        for n, o in zip(nodes, outs):
            n.replace_all_uses_with(o); g.erase_node(n)
        STATS["merged-groups"] += 1; STATS["merged-linears"] += len(nodes)
    g.lint()
class Merge(CustomGraphPass):
    def __call__(self, graph): merge(graph)
    def uuid(self): return "merge-siblings-v1"


aten = torch.ops.aten


def unfuse(graph):
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.addmm.default:
            continue
        bias, m1, m2 = node.args[:3]
        if node.kwargs or len(node.args) > 3 or not hasattr(bias, "meta") or bias.meta["val"].dim() != 1:
            continue
        with graph.inserting_before(node):
            mm = graph.call_function(aten.mm.default, (m1, m2))
            mm.meta["val"] = node.meta["val"].new_empty(node.meta["val"].shape)
            add = graph.call_function(aten.add.Tensor, (mm, bias))
            add.meta.update(node.meta)
        node.replace_all_uses_with(add)
        graph.erase_node(node)
        STATS["unfused-addmm"] += 1


class Unfuse(CustomGraphPass):
    def __call__(self, graph): unfuse(graph)
    def uuid(self): return "unfuse-addmm-v1"
