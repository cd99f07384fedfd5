// google-auth-library and gcp-metadata, unmodified, as an application in a
// pod would use them: GCE_METADATA_HOST / GCE_METADATA_IP alone point them
// at the metadata surface.
//
//   node google.mjs access-token        GoogleAuth -> getClient -> getAccessToken
//   node google.mjs id-token AUDIENCE   getIdTokenClient -> fetchIdToken
//   node google.mjs metadata            gcp-metadata isAvailable/instance/project
//   node google.mjs compute-select EMAIL AUDIENCE
//                                       Compute({serviceAccountEmail}): an access
//                                       token and an ID token of that account
import * as gcpMetadata from "gcp-metadata";
import { Compute, GoogleAuth } from "google-auth-library";
import { report } from "./report.mjs";

const SCOPES = ["https://www.googleapis.com/auth/devstorage.read_only"];

await report({
  "compute-select": async (email, audience) => {
    if (!email || !audience) throw new Error("compute-select needs EMAIL and AUDIENCE");
    const client = new Compute({ serviceAccountEmail: email, scopes: SCOPES });
    const { token } = await client.getAccessToken();
    if (!token) throw new Error("getAccessToken returned no token");
    const idToken = await client.fetchIdToken(audience);
    return { client: client.constructor.name, token, idToken };
  },
  "access-token": async () => {
    const auth = new GoogleAuth({ scopes: SCOPES });
    const client = await auth.getClient();
    const { token } = await client.getAccessToken();
    if (!token) throw new Error("getAccessToken returned no token");
    const projectId = await auth.getProjectId();
    const credentials = await auth.getCredentials();
    // What the library reads from a metadata server (its Compute client
    // keeps its own default otherwise).
    const universeDomain = await auth.getUniverseDomainFromMetadataServer();
    return {
      client: client.constructor.name,
      token,
      expiryDate: client.credentials.expiry_date ?? null,
      projectId,
      universeDomain,
      email: credentials.client_email ?? null,
      now: Date.now(),
    };
  },
  "id-token": async (audience) => {
    if (!audience) throw new Error("id-token needs an AUDIENCE argument");
    const auth = new GoogleAuth();
    const client = await auth.getIdTokenClient(audience);
    const token = await client.idTokenProvider.fetchIdToken(audience);
    return { client: client.constructor.name, provider: client.idTokenProvider.constructor.name, token };
  },
  metadata: async () => {
    const available = await gcpMetadata.isAvailable();
    const email = await gcpMetadata.instance("service-accounts/default/email");
    const projectId = await gcpMetadata.project("project-id");
    return { available, email, projectId };
  },
});
