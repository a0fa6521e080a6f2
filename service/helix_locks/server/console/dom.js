// DOM helpers that make elements from text only: no HTML string ever reaches the page.

const SVG_NS = 'http://www.w3.org/2000/svg';

export function $(id) {
  return document.getElementById(id);
}

export function el(tag, attributes, ...children) {
  const element = document.createElement(tag);
  setAttributes(element, attributes);
  for (const child of children) {
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return element;
}

export function svgEl(tag, attributes, text) {
  const element = document.createElementNS(SVG_NS, tag);
  setAttributes(element, attributes);
  if (text !== undefined) element.textContent = text;
  return element;
}

function setAttributes(element, attributes) {
  for (const [name, value] of Object.entries(attributes || {})) {
    if (value === null || value === undefined || value === false) continue;
    element.setAttribute(name, value === true ? '' : String(value));
  }
}

export function setStatus(text) {
  $('status').textContent = text;
}

export function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
