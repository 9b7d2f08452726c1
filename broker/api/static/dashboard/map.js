// The sites on an equirectangular world map (SVG): one dot per site, colored by its state,
// a label per region at its sites' centroid. Dots are created once and then only updated, so
// a refresh of 1,000 sites touches the attributes that changed and nothing else.

import { LAKES, LAND } from "./world.js";

const SVG = "http://www.w3.org/2000/svg";
const W = 1000;
const NORTH = 82;
const SOUTH = -58;
export const HEIGHT = ((NORTH - SOUTH) / 360) * W;

export function project(lat, lon) {
  return [((lon + 180) / 360) * W, ((NORTH - Math.min(NORTH, Math.max(SOUTH, lat))) / 360) * W];
}

function node(tag, attrs) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function ring(points) {
  return "M" + points.map(([lon, lat]) => project(lat, lon).map((v) => v.toFixed(1)).join(",")).join("L") + "Z";
}

export class SiteMap {
  constructor(svg) {
    this.svg = svg;
    svg.setAttribute("viewBox", `0 0 ${W} ${HEIGHT.toFixed(0)}`);
    const lines = [];
    for (let lon = -150; lon < 180; lon += 30) {
      const [x] = project(0, lon);
      lines.push(`M${x.toFixed(1)},0V${HEIGHT.toFixed(1)}`);
    }
    for (let lat = -30; lat <= 60; lat += 30) {
      const [, y] = project(lat, 0);
      lines.push(`M0,${y.toFixed(1)}H${W}`);
    }
    svg.append(node("path", { class: "graticule", d: lines.join("") }));
    svg.append(node("path", { class: "land", d: LAND.map(ring).join("") }));
    svg.append(node("path", { class: "lake", d: LAKES.map(ring).join(""), fill: "#0b1016" }));
    this.dotLayer = node("g", { class: "sites" });
    this.labelLayer = node("g", { class: "regions" });
    svg.append(this.dotLayer, this.labelLayer);
    this.dots = new Map(); // site id -> {el, title, state, x, y}
    this.labels = new Map(); // region -> text element
    this.cells = new Map(); // a 1-degree cell -> sites placed in it this pass (spread around it)
  }

  begin() {
    this.cells.clear();
    this.seen = new Set();
  }

  // Draw (or update) a page of sites as it arrives.
  draw(sites) {
    for (const site of sites) {
      this.seen.add(site.id);
      const c = site.coordinates || { lat: 0, lon: 0 };
      const cell = `${Math.round(c.lat)},${Math.round(c.lon)}`;
      const n = this.cells.get(cell) || 0;
      this.cells.set(cell, n + 1);
      // sites at one place spread on a small spiral (golden angle), so each stays visible
      let [x, y] = project(c.lat, c.lon);
      if (n > 0) {
        const r = 2.6 * Math.sqrt(n);
        x += r * Math.cos(n * 2.39996);
        y += r * Math.sin(n * 2.39996);
      }
      let dot = this.dots.get(site.id);
      if (dot === undefined) {
        const el = node("circle", { r: "3.2", "data-site": site.id });
        const title = node("title", {});
        el.append(title);
        this.dotLayer.append(el);
        dot = { el, title, state: null, x: null, y: null, text: null };
        this.dots.set(site.id, dot);
      }
      if (dot.state !== site.state) {
        dot.el.setAttribute("class", "site " + site.state);
        dot.el.setAttribute("data-state", site.state);
        dot.state = site.state;
      }
      if (dot.x !== x || dot.y !== y) {
        dot.el.setAttribute("cx", x.toFixed(1));
        dot.el.setAttribute("cy", y.toFixed(1));
        dot.x = x;
        dot.y = y;
      }
      const text = `${site.id} (${site.region}): ${site.state}`;
      if (dot.text !== text) {
        dot.title.textContent = text;
        dot.text = text;
      }
    }
  }

  // After the last page: drop the sites that left, label each region at its centroid.
  end(regions) {
    for (const [id, dot] of this.dots) {
      if (!this.seen.has(id)) {
        dot.el.remove();
        this.dots.delete(id);
      }
    }
    for (const [name, label] of this.labels) {
      if (!regions.has(name)) {
        label.remove();
        this.labels.delete(name);
      }
    }
    for (const [name, r] of regions) {
      const [x, y] = project(r.lat / r.sites, r.lon / r.sites);
      let label = this.labels.get(name);
      if (label === undefined) {
        label = node("text", { class: "region-label" });
        this.labelLayer.append(label);
        this.labels.set(name, label);
      }
      label.setAttribute("x", (x + 6).toFixed(1));
      label.setAttribute("y", (y - 6).toFixed(1));
      label.textContent = `${name} ${r.up}/${r.sites}`;
    }
  }
}
