// The official `e2b` JavaScript SDK against a real spaced (issue 13, decision 0022).
//
// Run with node's own test runner by the Rust integration tests `e2b::the_official_js_sdk_*`,
// which start spaced in its own network namespace and set E2B_API_KEY (`space e2b env`'s
// form), E2B_API_URL, E2B_SANDBOX_URL, and SPACE_E2B_JS: the node_modules of the SDK version
// under test. Nothing here imitates the SDK: every call is the SDK's own.
'use strict'

const test = require('node:test')
const assert = require('node:assert/strict')
const path = require('node:path')

const e2b = require(path.join(process.env.SPACE_E2B_JS, 'e2b'))
const { Sandbox, CommandExitError, NotFoundError, AuthenticationError, TimeoutError } = e2b

const URL = process.env.E2B_API_URL
const NATIVE = { Authorization: `Bearer ${process.env.SPACE_API_KEY}` }

async function native(sbx) {
  const r = await fetch(`${URL}/v1/sandboxes/${sbx.sandboxId}`, { headers: NATIVE })
  assert.equal(r.status, 200)
  return r.json()
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

test('commands', async (t) => {
  const sbx = await Sandbox.create({ envs: { GREETING: 'hello' }, metadata: { suite: 'js' } })
  t.after(() => sbx.kill())

  await t.test('run returns output and the exit code', async () => {
    const r = await sbx.commands.run('echo hi; echo err >&2')
    assert.deepEqual([r.stdout, r.stderr, r.exitCode], ['hi\n', 'err\n', 0])
  })

  await t.test('the defaults are the ones E2B code expects', async () => {
    const r = await sbx.commands.run('whoami; pwd; echo "$GREETING $HOME"')
    assert.equal(r.stdout, 'user\n/home/user\nhello /home/user\n')
    assert.equal((await sbx.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
    const e = await sbx.commands.run('echo $X; pwd', { envs: { X: '42' }, cwd: '/tmp' })
    assert.equal(e.stdout, '42\n/tmp\n')
  })

  await t.test('a failing command throws CommandExitError', async () => {
    await assert.rejects(sbx.commands.run('echo out; exit 3'), (err) => {
      assert.ok(err instanceof CommandExitError)
      assert.equal(err.exitCode, 3)
      assert.equal(err.stdout, 'out\n')
      return true
    })
  })

  await t.test('a background command outlives its client and is reconnected', async () => {
    const h = await sbx.commands.run('for i in 1 2 3; do echo $i; sleep 0.2; done', { background: true })
    await h.disconnect()
    const again = await sbx.commands.connect(h.pid)
    const r = await again.wait()
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, '1\n2\n3\n')
  })

  await t.test('streamed output, stdin and kill', async () => {
    const chunks = []
    const h = await sbx.commands.run('cat', { background: true, stdin: true, onStdout: (d) => chunks.push(d) })
    await sbx.commands.sendStdin(h.pid, 'ping\n')
    for (let i = 0; i < 100 && chunks.join('') !== 'ping\n'; i++) await sleep(50)
    assert.equal(chunks.join(''), 'ping\n')
    assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid))
    assert.equal(await sbx.commands.kill(h.pid), true)
    await assert.rejects(h.wait())
  })

  await t.test('a command timeout is a TimeoutError', async () => {
    await assert.rejects(sbx.commands.run('sleep 5', { timeoutMs: 500 }), TimeoutError)
  })

  await t.test('a PTY session with input and resize', async () => {
    let out = ''
    const dec = new TextDecoder()
    const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { out += dec.decode(d) } })
    await sbx.pty.resize(pty.pid, { cols: 100, rows: 30 })
    await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('stty size; exit\n'))
    const r = await pty.wait()
    assert.equal(r.exitCode, 0)
    assert.match(out, /30 100/)
  })
})

test('files', async (t) => {
  const sbx = await Sandbox.create()
  t.after(() => sbx.kill())

  await t.test('write, read, list, rename and remove', async () => {
    const info = await sbx.files.write('notes/a.txt', 'alpha')
    assert.equal(info.path, '/home/user/notes/a.txt')
    assert.equal(await sbx.files.read('/home/user/notes/a.txt'), 'alpha')
    assert.deepEqual((await sbx.files.list('notes')).map((e) => e.name), ['a.txt'])
    assert.equal(await sbx.files.makeDir('notes'), false)
    await sbx.files.rename('notes/a.txt', 'notes/b.txt')
    assert.equal(await sbx.files.exists('notes/a.txt'), false)
    const st = await sbx.files.getInfo('notes/b.txt')
    assert.equal(st.size, 5)
    assert.equal(st.owner, 'user')
    await sbx.files.remove('notes')
    assert.equal(await sbx.files.exists('notes'), false)
  })

  await t.test('a large file round trip', async () => {
    const big = new Uint8Array(24 << 20)
    for (let i = 0; i < big.length; i++) big[i] = (i * 7919) & 0xff
    await sbx.files.write('/tmp/big.bin', big.buffer)
    const back = await sbx.files.read('/tmp/big.bin', { format: 'bytes' })
    assert.equal(back.length, big.length)
    assert.ok(Buffer.from(back).equals(Buffer.from(big)))
    const sum = await sbx.commands.run('sha256sum /tmp/big.bin | cut -c1-64')
    const want = require('node:crypto').createHash('sha256').update(big).digest('hex')
    assert.equal(sum.stdout.trim(), want)
  })

  await t.test('a missing file is a NotFoundError', async () => {
    await assert.rejects(sbx.files.read('/nope/missing'), NotFoundError)
  })

  await t.test('a watch sees changes as they happen', async () => {
    await sbx.files.makeDir('/tmp/w')
    const events = []
    const w = await sbx.files.watchDir('/tmp/w', (e) => events.push(e), { recursive: true })
    await sbx.commands.run('echo x > /tmp/w/f')
    for (let i = 0; i < 100 && !events.some((e) => e.name === 'f'); i++) await sleep(50)
    await w.stop()
    assert.ok(events.some((e) => e.name === 'f'), JSON.stringify(events))
  })
})

test('lifecycle', async (t) => {
  await t.test('info, list, timeout, metrics and kill', async () => {
    const sbx = await Sandbox.create({ metadata: { who: 'lifecycle-js' }, timeoutMs: 120_000 })
    try {
      const info = await sbx.getInfo()
      assert.equal(info.sandboxId, sbx.sandboxId)
      assert.equal(info.metadata.who, 'lifecycle-js')
      const page = await Sandbox.list({ query: { metadata: { who: 'lifecycle-js' } } }).nextItems()
      assert.deepEqual(page.map((s) => s.sandboxId), [sbx.sandboxId])
      await sbx.setTimeout(600_000)
      const end = Date.parse((await native(sbx)).timeout_at)
      assert.ok(end > Date.now() + 500_000)
      const metrics = await sbx.getMetrics()
      assert.ok(metrics.length >= 1)
      assert.ok(metrics.at(-1).memTotal > 0 && metrics.at(-1).diskTotal > 0)
      assert.equal(await sbx.isRunning(), true)
    } finally {
      await sbx.kill()
    }
    await assert.rejects(Sandbox.connect(sbx.sandboxId), NotFoundError)
  })

  await t.test('pause and resume through connect keep files and processes', async () => {
    const sbx = await Sandbox.create()
    try {
      await sbx.commands.run('echo kept > /home/user/f')
      const h = await sbx.commands.run('sleep 300', { background: true })
      await sbx.pause()
      assert.equal((await sbx.getInfo()).state, 'paused')
      const back = await Sandbox.connect(sbx.sandboxId)
      assert.equal((await back.commands.run('cat /home/user/f')).stdout, 'kept\n')
      assert.ok((await back.commands.list()).some((p) => p.pid === h.pid))
    } finally {
      await sbx.kill()
    }
  })

  await t.test('a wrong key is an AuthenticationError', async () => {
    await assert.rejects(Sandbox.create({ apiKey: 'e2b_' + '00'.repeat(21) }), AuthenticationError)
  })

  await t.test('an unknown template is refused with its name', async () => {
    await assert.rejects(Sandbox.create('no-such-template'), /no-such-template/)
  })
})
