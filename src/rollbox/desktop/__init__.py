"""``rollbox demo --backend vm --task desktop``: a computer-use episode on the ``desktop:1`` VM
(issue 16 item 5): a scripted agent that sees screenshots and acts by mouse and keyboard only,
graded by replaying the platform's record of its input in a fresh VM (``episode.py``, which
decodes the screenshots and draws the step strip with Pillow).

Above the SDK and the embedded node (like ``rollbox.browser``); nothing of the runtime imports
it. Touches no backend or edge code: everything goes through the SDK.
"""
