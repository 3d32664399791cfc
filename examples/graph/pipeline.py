"""rewrite prompt -> LLM -> post-process: custom nodes around a vLLM engine node, no HTTP code.

`Generate` has a constructor parameter named `llm`, the serve_id of the engine node, so it receives a client
for it: `await self.llm.generate(prompt, **sampling)` returns the generated text.
"""


class Rewrite:
    def forward(self, prompt: str, max_tokens: int) -> dict:
        return {"prompt": f"Question: {prompt.strip()}\nAnswer:", "max_tokens": max_tokens}


class Generate:
    def __init__(self, llm):
        self.llm = llm

    async def forward(self, request: dict) -> dict:
        text = await self.llm.generate(
            request["prompt"], max_tokens=request["max_tokens"], temperature=0, ignore_eos=True
        )
        return {"prompt": request["prompt"], "completion": text}


class PostProcess:
    def forward(self, generated: dict) -> dict:
        text = generated["completion"].strip()
        return {"prompt": generated["prompt"], "text": text, "chars": len(text)}
