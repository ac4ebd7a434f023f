// The API reference page (/docs): renders this server's /openapi.json as elements (never
// innerHTML: every name and description is text) and sends a request from an operation's form.
// Loaded from this origin only (the page's Content-Security-Policy allows nothing else).
"use strict";

(function () {
  const METHODS = ["get", "post", "put", "patch", "delete"];
  let spec = null;

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (name === "text") node.textContent = value;
      else node.setAttribute(name, value);
    }
    for (const child of children) {
      if (child !== null && child !== undefined) {
        node.append(typeof child === "string" ? document.createTextNode(child) : child);
      }
    }
    return node;
  }

  function refName(ref) { return ref.split("/").pop(); }

  function resolve(schema) {
    let seen = 0;
    while (schema && schema.$ref && seen++ < 16) {
      schema = (spec.components?.schemas || {})[refName(schema.$ref)] || {};
    }
    return schema || {};
  }

  // A schema's type, inline: a link for a named schema, "A | B" for a union.
  function typeLabel(schema) {
    schema = schema || {};
    if (schema.$ref) {
      const name = refName(schema.$ref);
      return el("a", { href: "#schema-" + name, class: "ref", text: name });
    }
    const union = schema.anyOf || schema.oneOf;
    if (union) {
      const span = el("span");
      union.forEach((part, i) => { if (i) span.append(" | "); span.append(typeLabel(part)); });
      return span;
    }
    if (schema.enum) return el("span", { text: schema.enum.map((v) => JSON.stringify(v)).join(" | ") });
    if ("const" in schema) return el("span", { text: JSON.stringify(schema.const) });
    if (schema.type === "array") {
      return el("span", {}, "array of ", typeLabel(schema.items || {}));
    }
    if (schema.type === "object" && schema.additionalProperties && typeof schema.additionalProperties === "object") {
      return el("span", {}, "object of ", typeLabel(schema.additionalProperties));
    }
    const type = Array.isArray(schema.type) ? schema.type.join(" | ") : schema.type;
    return el("span", { text: type || "any" });
  }

  // A table of an object schema's properties (name, type, default, description).
  function propertyTable(schema) {
    schema = resolve(schema);
    const props = schema.properties || {};
    const required = new Set(schema.required || []);
    if (!Object.keys(props).length) return el("p", {}, "Type: ", typeLabel(schema));
    const body = el("tbody");
    for (const [name, prop] of Object.entries(props)) {
      const def = "default" in prop ? JSON.stringify(prop.default) : "";
      body.append(el("tr", {},
        el("td", {}, el("code", { text: name }), required.has(name) ? el("span", { class: "req", text: " required" }) : null),
        el("td", {}, typeLabel(prop)),
        el("td", {}, el("code", { text: def })),
        el("td", { text: prop.description || prop.title || "" })));
    }
    return el("table", {},
      el("thead", {}, el("tr", {}, ...["name", "type", "default", "description"].map((h) => el("th", { text: h })))),
      body);
  }

  // A JSON value to start a request body from: the required fields, with their defaults.
  function example(schema, depth) {
    schema = resolve(schema);
    if (depth > 4) return null;
    if ("example" in schema) return schema.example;
    if (schema.examples && schema.examples.length) return schema.examples[0];
    if ("default" in schema) return schema.default;
    const union = schema.anyOf || schema.oneOf;
    if (union) return example(union.find((s) => s.type !== "null") || union[0], depth + 1);
    if (schema.enum) return schema.enum[0];
    switch (schema.type) {
      case "object": {
        const out = {};
        for (const name of schema.required || []) {
          out[name] = example((schema.properties || {})[name] || {}, depth + 1);
        }
        return out;
      }
      case "array": return [];
      case "string": return "";
      case "integer": case "number": return 0;
      case "boolean": return false;
      default: return null;
    }
  }

  function jsonSchemaOf(content) {
    const json = (content || {})["application/json"];
    return json && json.schema;
  }

  function tryItForm(path, method, op) {
    const params = (op.parameters || []).filter((p) => p.in === "path" || p.in === "query");
    const inputs = params.map((p) => el("input", { "data-name": p.name, "data-in": p.in, placeholder: p.name }));
    const bodySchema = jsonSchemaOf(op.requestBody?.content);
    const body = bodySchema
      ? el("textarea", { rows: "8", spellcheck: "false" })
      : null;
    if (body) body.value = JSON.stringify(example(bodySchema, 0), null, 2);
    const send = el("button", { type: "button", text: "Send" });
    const out = el("pre", { class: "reply" });
    send.addEventListener("click", async () => {
      let url = path;
      const query = new URLSearchParams();
      for (const input of inputs) {
        const name = input.dataset.name;
        if (input.dataset.in === "path") url = url.replace("{" + name + "}", encodeURIComponent(input.value));
        else if (input.value !== "") query.append(name, input.value);
      }
      if ([...query].length) url += "?" + query;
      const headers = {};
      const key = document.getElementById("api-key").value.trim();
      if (key) headers.Authorization = "Bearer " + key;
      const init = { method: method.toUpperCase(), headers };
      if (body) { headers["Content-Type"] = "application/json"; init.body = body.value; }
      out.textContent = "…";
      try {
        const resp = await fetch(url, init);
        let text = await resp.text();
        try { text = JSON.stringify(JSON.parse(text), null, 2); } catch (e) { /* not JSON */ }
        out.textContent = resp.status + " " + resp.statusText + "\n" + text;
      } catch (err) {
        out.textContent = String(err);
      }
    });
    const labels = inputs.map((input, i) => el("label", {}, params[i].name + (params[i].required ? " (required) " : " "), input));
    return el("div", { class: "try" }, el("h4", { text: "Try it" }), ...labels, body, send, out);
  }

  function operation(path, method, op) {
    const id = "op-" + method + "-" + path.replace(/[^A-Za-z0-9]+/g, "-");
    const details = el("details", { class: "op", id },
      el("summary", {},
        el("span", { class: "method " + method, text: method.toUpperCase() }),
        el("code", { class: "path", text: path }),
        el("span", { class: "summary", text: op.summary || "" })));
    if (op.description) details.append(el("p", { class: "description", text: op.description }));
    const params = op.parameters || [];
    if (params.length) {
      const rows = params.map((p) => el("tr", {},
        el("td", {}, el("code", { text: p.name }), p.required ? el("span", { class: "req", text: " required" }) : null),
        el("td", { text: p.in }),
        el("td", {}, typeLabel(p.schema)),
        el("td", { text: p.description || "" })));
      details.append(el("h4", { text: "Parameters" }), el("table", {},
        el("thead", {}, el("tr", {}, ...["name", "in", "type", "description"].map((h) => el("th", { text: h })))),
        el("tbody", {}, ...rows)));
    }
    const bodySchema = jsonSchemaOf(op.requestBody?.content);
    if (bodySchema) {
      details.append(el("h4", {}, "Request body: ", typeLabel(bodySchema)), propertyTable(bodySchema));
    }
    const responses = Object.entries(op.responses || {});
    if (responses.length) {
      const list = el("ul", { class: "responses" });
      for (const [code, resp] of responses) {
        const schema = jsonSchemaOf(resp.content);
        list.append(el("li", {}, el("code", { text: code }), " " + (resp.description || "") + " ",
          schema ? typeLabel(schema) : null));
      }
      details.append(el("h4", { text: "Responses" }), list);
    }
    details.append(tryItForm(path, method, op));
    return details;
  }

  function render() {
    const info = spec.info || {};
    document.title = (info.title || "API") + " reference";
    document.getElementById("title").textContent = (info.title || "API") + " " + (info.version || "");
    const ops = document.getElementById("operations");
    ops.replaceChildren(el("h2", { text: "Operations" }));
    for (const [path, item] of Object.entries(spec.paths || {})) {
      for (const method of METHODS) {
        if (item[method]) ops.append(operation(path, method, item[method]));
      }
    }
    const schemas = document.getElementById("schemas");
    schemas.replaceChildren(el("h2", { text: "Schemas" }));
    for (const [name, schema] of Object.entries(spec.components?.schemas || {})) {
      schemas.append(el("details", { class: "schema", id: "schema-" + name },
        el("summary", {}, el("code", { text: name })),
        schema.description ? el("p", { class: "description", text: schema.description }) : null,
        propertyTable(schema)));
    }
  }

  // A link to a schema opens it.
  document.addEventListener("click", (event) => {
    const link = event.target.closest && event.target.closest("a.ref");
    if (!link) return;
    const target = document.getElementById(link.getAttribute("href").slice(1));
    if (target) target.open = true;
  });

  fetch("/openapi.json")
    .then((resp) => {
      if (!resp.ok) throw new Error("/openapi.json: HTTP " + resp.status);
      return resp.json();
    })
    .then((json) => { spec = json; render(); })
    .catch((err) => { document.getElementById("status").textContent = String(err); });
})();
