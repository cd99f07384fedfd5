// Shared by the client scripts: run one scenario, print what the client got
// as a single JSON line on stdout, or the error on stderr with exit code 1,
// so that pytest (tests/python/test_node_clients.py) shows why it failed.

export async function report(scenarios) {
  const name = process.argv[2];
  const scenario = scenarios[name];
  if (!scenario) {
    process.stderr.write(`usage: node ${process.argv[1]} ${Object.keys(scenarios).join("|")} [ARG...]\n`);
    process.exit(2);
  }
  try {
    const result = await scenario(...process.argv.slice(3));
    process.stdout.write(JSON.stringify(result) + "\n");
    process.exit(0);
  } catch (err) {
    process.stderr.write(`${name} failed: ${describe(err)}\n`);
    process.exit(1);
  }
}

// The message, the causes and (for aggregate errors) every inner error:
// SDK errors often wrap the HTTP failure that explains them.
function describe(err, depth = 0) {
  if (depth > 5 || err === undefined || err === null) return String(err);
  let text = err.stack || `${err.name || "Error"}: ${err.message || err}`;
  if (err.response && err.response.status !== undefined) {
    text += `\n  HTTP ${err.response.status}: ${JSON.stringify(err.response.data ?? err.response.body ?? "")}`;
  }
  if (Array.isArray(err.errors)) {
    for (const inner of err.errors) text += `\n  inner: ${describe(inner, depth + 1)}`;
  }
  if (err.cause) text += `\n  cause: ${describe(err.cause, depth + 1)}`;
  return text;
}
