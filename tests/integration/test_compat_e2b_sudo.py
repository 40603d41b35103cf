"""The unmodified ``e2b`` SDK's ``commands.run("sudo ...")`` in E2B's ``base`` template
(rollbox's e2b-base: user ``user``, the agent-mediated sudo of docs/security.md): a real edge,
the real api app on a real port, real container sandboxes."""
from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from rollbox.default_images import E2B_BASE_IMAGE
from tests.conftest import have_image
from tests.helpers.e2b_node import e2b_node

e2b = pytest.importorskip("e2b")

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(not have_image(E2B_BASE_IMAGE), reason=f"{E2B_BASE_IMAGE} not built"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node() -> AsyncIterator[None]:
    async with e2b_node("e2b-sudo"):
        yield


async def test_sudo_as_user_in_base(node: None) -> None:
    from e2b import AsyncSandbox, CommandExitException

    sbx = await AsyncSandbox.create("base", timeout=120)
    try:
        res = await sbx.commands.run("whoami; echo $HOME; sudo whoami")
        assert res.stdout.split() == ["user", "/home/user", "root"]
        # E2B's scoped env: not visible to a later command, nor through sudo's reset env.
        res = await sbx.commands.run('sudo echo "$FOO"; sudo FOO=bar sh -c "echo \\$FOO"',
                                     envs={"FOO": "leak"})
        assert res.stdout.splitlines() == ["leak", "bar"]
        res = await sbx.commands.run("sudo sh -c 'echo $FOO'", envs={"FOO": "leak"})
        assert res.stdout == "\n"
        res = await sbx.commands.run("sudo sh -c 'id -u > /etc/made-by-sudo'; "
                                     "stat -c %U /etc/made-by-sudo")
        assert res.stdout.strip() == "root"
        with pytest.raises(CommandExitException) as ex:
            await sbx.commands.run("sudo sh -c 'exit 5'")
        assert ex.value.exit_code == 5
        with pytest.raises(CommandExitException) as ex:
            await sbx.commands.run("sudo no-such-command")
        assert ex.value.exit_code == 1 and "command not found" in ex.value.stderr
        res = await sbx.commands.run("sudo whoami", user="root")  # root may sudo too
        assert res.stdout.strip() == "root"
    finally:
        await sbx.kill()
