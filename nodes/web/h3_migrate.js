// Workflows saved with earlier node inputs, brought to the current ones as they are loaded (a drop, a file, a
// template), before the canvas builds them:
//  * H3 Text Encode and H3 Sampler had width / height / length widgets of their own; they now read one
//    H3 Canvas node. One canvas is added per distinct size, holding the old values (or links), and wired to both.
//  * H3 Attention & Memory gained a `compile` widget (auto), appended after the four it had.
//  * H3 LoRA nodes (H3LoraList) used to form a list the DiT loader merged; they are now H3LoraLoader nodes that
//    take the model and return it patched, chained in the same order between the loader and its consumers.
import { app } from "../../scripts/app.js";

const CANVAS_WIDGETS = ["width", "height", "length"];
const OLD_WIDGETS = { H3TextEncode: 4, H3Sampler: 8 }; // widget values before the canvas moved out (seed control aside)

function linkRecord(link) {
  if (Array.isArray(link)) {
    return { id: link[0], origin: link[1], originSlot: link[2], target: link[3], targetSlot: link[4], type: link[5] };
  }
  return { id: link.id, origin: link.origin_id, originSlot: link.origin_slot, target: link.target_id,
           targetSlot: link.target_slot, type: link.type };
}

class Graph {
  constructor(data) {
    this.data = data;
    this.nodes = new Map(data.nodes.map((n) => [n.id, n]));
    this.objectLinks = data.links.length > 0 && !Array.isArray(data.links[0]);
  }
  newNodeId() {
    const next = Math.max(this.data.last_node_id ?? 0, ...this.data.nodes.map((n) => Number(n.id) || 0)) + 1;
    this.data.last_node_id = next;
    return next;
  }
  newLinkId() {
    const ids = this.data.links.map((l) => linkRecord(l).id);
    const next = Math.max(this.data.last_link_id ?? 0, ...ids, 0) + 1;
    this.data.last_link_id = next;
    return next;
  }
  link(id) {
    return this.data.links.map(linkRecord).find((l) => l.id === id);
  }
  removeLink(id) {
    const record = this.link(id);
    if (!record) return;
    this.data.links = this.data.links.filter((l) => linkRecord(l).id !== id);
    const origin = this.nodes.get(record.origin);
    const output = origin?.outputs?.[record.originSlot];
    if (output?.links) output.links = output.links.filter((l) => l !== id);
    const target = this.nodes.get(record.target);
    for (const input of target?.inputs ?? []) if (input.link === id) input.link = null;
  }
  connect(origin, originSlot, target, inputName, type, widget) {
    const id = this.newLinkId();
    target.inputs ??= [];
    let slot = target.inputs.findIndex((i) => i.name === inputName);
    if (slot < 0) {
      target.inputs.push({ name: inputName, type, link: id, ...(widget ? { widget: { name: inputName } } : {}) });
      slot = target.inputs.length - 1;
    } else {
      target.inputs[slot].link = id;
    }
    const output = origin.outputs[originSlot];
    output.links = [...(output.links ?? []), id];
    this.data.links.push(this.objectLinks
      ? { id, origin_id: origin.id, origin_slot: originSlot, target_id: target.id, target_slot: slot, type }
      : [id, origin.id, originSlot, target.id, slot, type]);
  }
  dropInput(node, input) {
    // Removing an input shifts the slots after it: every link into the node is renumbered.
    if (input.link != null) this.removeLink(input.link);
    node.inputs = node.inputs.filter((i) => i !== input);
    node.inputs.forEach((i, slot) => {
      if (i.link == null) return;
      const link = this.data.links.find((l) => linkRecord(l).id === i.link);
      if (Array.isArray(link)) link[4] = slot;
      else if (link) link.target_slot = slot;
    });
  }
  addNode(type, pos, widgets, outputs, inputs = []) {
    const node = { id: this.newNodeId(), type, pos, size: [320, 130], flags: {}, order: this.data.nodes.length,
                   mode: 0, inputs, outputs: outputs.map(([name, t], i) => ({ name, type: t, links: [], slot_index: i })),
                   properties: { "Node name for S&R": type }, widgets_values: widgets };
    this.data.nodes.push(node);
    this.nodes.set(node.id, node);
    return node;
  }
}

function oldCanvasNode(node) {
  const count = OLD_WIDGETS[node.type];
  return count !== undefined && !(node.inputs ?? []).some((i) => i.name === "canvas")
    && Array.isArray(node.widgets_values) && node.widgets_values.length >= count;
}

function moveCanvas(graph) {
  const canvases = new Map();
  for (const node of graph.data.nodes.filter(oldCanvasNode)) {
    // width, height, length followed the first widget: the sampler's mode, the text encode's prompt
    const values = node.widgets_values;
    const size = values.slice(1, 4);
    node.widgets_values = [values[0], ...values.slice(4)];
    const linked = {};
    for (const name of CANVAS_WIDGETS) {
      const input = (node.inputs ?? []).find((i) => i.name === name);
      if (input?.link != null) linked[name] = graph.link(input.link);
      if (input) graph.dropInput(node, input);
    }
    const key = JSON.stringify([size, Object.values(linked).map((l) => [l.origin, l.originSlot])]);
    let canvas = canvases.get(key);
    if (!canvas) {
      const [x, y] = node.pos ?? [0, 0];
      canvas = graph.addNode("H3Canvas", [x - 360, y + 260], size,
        [["canvas", "H3_CANVAS"], ["width", "INT"], ["height", "INT"], ["length", "INT"]]);
      for (const [name, l] of Object.entries(linked)) {
        graph.connect(graph.nodes.get(l.origin), l.originSlot, canvas, name, l.type, true);
      }
      canvases.set(key, canvas);
    }
    graph.connect(canvas, 0, node, "canvas", "H3_CANVAS");
  }
  return canvases.size;
}

function addCompileWidget(graph) {
  let changed = 0;
  for (const node of graph.data.nodes) {
    if (node.type === "H3AttentionSettings" && Array.isArray(node.widgets_values) && node.widgets_values.length === 4) {
      node.widgets_values = [...node.widgets_values, "auto"];
      changed += 1;
    }
  }
  return changed;
}

function chainLoras(graph) {
  let changed = 0;
  for (const loader of graph.data.nodes.filter((n) => n.type === "H3DiTLoader")) {
    const lorasInput = (loader.inputs ?? []).find((i) => i.name === "loras");
    if (!lorasInput) continue;
    const chain = [];
    let link = lorasInput.link != null ? graph.link(lorasInput.link) : null;
    while (link) {
      const node = graph.nodes.get(link.origin);
      if (!node || node.type !== "H3LoraList") break;
      chain.unshift(node);
      const previous = (node.inputs ?? []).find((i) => i.name === "loras");
      link = previous?.link != null ? graph.link(previous.link) : null;
    }
    graph.dropInput(loader, lorasInput);
    if (chain.length === 0) continue;
    const consumers = (loader.outputs[0].links ?? []).map((id) => graph.link(id)).filter(Boolean);
    for (const l of consumers) graph.removeLink(l.id);
    let source = loader;
    for (const node of chain) {
      for (const input of node.inputs ?? []) if (input.link != null) graph.removeLink(input.link);
      for (const id of node.outputs?.[0]?.links ?? []) graph.removeLink(id);
      node.type = "H3LoraLoader";
      node.properties = { ...(node.properties ?? {}), "Node name for S&R": "H3LoraLoader" };
      node.inputs = [];
      node.outputs = [{ name: "model", type: "H3_MODEL", links: [], slot_index: 0 }];
      graph.connect(source, 0, node, "model", "H3_MODEL");
      source = node;
    }
    for (const l of consumers) {
      const target = graph.nodes.get(l.target);
      const name = target.inputs[l.targetSlot]?.name ?? "model";
      graph.connect(source, 0, target, name, "H3_MODEL");
    }
    changed += chain.length;
  }
  return changed;
}

export function migrateH3Workflow(data) {
  if (!data || !Array.isArray(data.nodes) || !Array.isArray(data.links)) return 0;
  const graph = new Graph(data);
  const changed = chainLoras(graph) + moveCanvas(graph) + addCompileWidget(graph);
  if (changed) console.info(`[H3 Hybrid] brought ${changed} node(s) of this workflow to the current H3 node inputs`);
  return changed;
}

app.registerExtension({
  name: "H3Hybrid.Migrate",
  beforeConfigureGraph(graphData) {
    migrateH3Workflow(graphData);
  },
});
