// @azure/identity, unmodified, as an application in a pod would use it: the
// environment alone (what `lanyard dev` exports or the webhook injects)
// decides which managed-identity surface the credential reaches.
//
//   node azure.mjs managed-identity            system-assigned
//   node azure.mjs managed-identity-client-id  clientId = $AZURE_CLIENT_ID
//   node azure.mjs default                     DefaultAzureCredential
//   node azure.mjs managed-identity-select ID  clientId = ID (one of several
//                                              the ServiceAccount lists)
import { DefaultAzureCredential, ManagedIdentityCredential } from "@azure/identity";
import { report } from "./report.mjs";

const SCOPE = "https://storage.azure.com/.default";

async function token(credential) {
  const got = await credential.getToken(SCOPE);
  if (!got) throw new Error(`${credential.constructor.name}.getToken returned ${got}`);
  return {
    credential: credential.constructor.name,
    token: got.token,
    tokenType: got.tokenType ?? null,
    expiresOnTimestamp: got.expiresOnTimestamp,
    refreshAfterTimestamp: got.refreshAfterTimestamp ?? null,
    now: Date.now(),
  };
}

await report({
  "managed-identity": () => token(new ManagedIdentityCredential()),
  "managed-identity-client-id": () =>
    token(new ManagedIdentityCredential({ clientId: process.env.AZURE_CLIENT_ID })),
  default: () => token(new DefaultAzureCredential()),
  "managed-identity-select": (clientId) => {
    if (!clientId) throw new Error("managed-identity-select needs a client id");
    return token(new ManagedIdentityCredential({ clientId }));
  },
});
