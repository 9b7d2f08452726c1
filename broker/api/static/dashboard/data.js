// The dashboard's side of the API: the bearer token and the calls that carry it.
//
// The token comes from the URL fragment (#token=cpn_...: browsers never send a fragment to the
// server, so it is in no request line and no log) or from the form, and is kept in this tab's
// sessionStorage; the fragment is removed from the address bar at once. It goes out only in the
// Authorization header of same-origin calls (the page's Content-Security-Policy allows no other).

const KEY = "cpn.dashboard.token";

export function takeToken() {
  const params = new URLSearchParams(window.location.hash.slice(1));
  const given = params.get("token");
  if (given) {
    sessionStorage.setItem(KEY, given.trim());
    params.delete("token");
    const rest = params.toString();
    history.replaceState(null, "", window.location.pathname + (rest ? "#" + rest : ""));
  }
  return sessionStorage.getItem(KEY);
}

export function setToken(token) {
  sessionStorage.setItem(KEY, token.trim());
}

export function forgetToken() {
  sessionStorage.removeItem(KEY);
}

// An error the panels show: status 0 is the broker not answering.
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export async function api(path, { signal } = {}) {
  const token = sessionStorage.getItem(KEY);
  let response;
  try {
    response = await fetch(path, {
      headers: token ? { Authorization: "Bearer " + token } : {},
      cache: "no-store",
      credentials: "omit",
      signal,
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "unreachable", "the broker does not answer");
  }
  if (!response.ok) {
    let code = "http_" + response.status;
    let message = response.statusText;
    try {
      const body = await response.json();
      code = body.error.code;
      message = body.error.message;
    } catch (_) {
      // not the broker's JSON error: keep the status line
    }
    throw new ApiError(response.status, code, message);
  }
  return response.json();
}

// Every page of a paged list ({"items", "continue"}), handing each page to `onPage` as it
// arrives, so that the first sites are drawn before the last are fetched.
export async function pages(path, limit, onPage, { signal } = {}) {
  let next = null;
  const sep = path.includes("?") ? "&" : "?";
  do {
    const url = `${path}${sep}limit=${limit}` + (next ? `&continue=${encodeURIComponent(next)}` : "");
    const page = await api(url, { signal });
    onPage(page.items);
    next = page.continue;
  } while (next);
}
