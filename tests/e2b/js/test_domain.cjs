// The official `e2b` JavaScript SDK reaching space by domain, over TLS (decision 0030).
//
// Run by the Rust integration test `e2b::the_sdks_reach_space_by_domain_over_tls` with only
// E2B_API_KEY and E2B_DOMAIN (`space e2b env --domain`) and NODE_EXTRA_CA_CERTS naming the CA
// `space e2b ca` printed; the test's DNS answers the domain and every name under it.
'use strict'

const test = require('node:test')
const assert = require('node:assert/strict')
const path = require('node:path')

const { Sandbox } = require(path.join(process.env.SPACE_E2B_JS, 'e2b'))
const DOMAIN = process.env.E2B_DOMAIN

test('the SDK reaches space by its domain', async () => {
  assert.equal(process.env.E2B_API_URL, undefined)
  assert.equal(process.env.E2B_SANDBOX_URL, undefined)
  const sbx = await Sandbox.create({ metadata: { suite: 'js-domain' } })
  try {
    assert.equal(sbx.sandboxDomain, DOMAIN)
    assert.equal(sbx.getHost(8000), `8000-${sbx.sandboxId}.${DOMAIN}`)
    const r = await sbx.commands.run('echo hi; whoami')
    assert.deepEqual([r.stdout, r.exitCode], ['hi\nuser\n', 0])
    await sbx.files.write('/home/user/by-domain.txt', 'over TLS')
    assert.equal(await sbx.files.read('/home/user/by-domain.txt'), 'over TLS')
    assert.equal(await sbx.isRunning(), true)
    const health = await fetch(`https://api.${DOMAIN}/healthz`)
    assert.equal(health.status, 200)
  } finally {
    await sbx.kill()
  }
})
