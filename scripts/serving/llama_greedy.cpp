// Greedy continuations of token-id prompts with llama.cpp (libllama), for scripts/check_serving.sh.
//
// llama.cpp's own tools take text and tokenize it; our checks feed token ids (the exported models have
// no real tokenizer), so this reads them directly. Usage:
//   llama_greedy MODEL.gguf N_NEW < prompts.txt      (one prompt per line: space-separated token ids)
// prints one line per prompt: the N_NEW greedy ids (end-of-generation tokens do not stop it, as
// ignore_eos does in the other engines). Each prompt runs in a fresh context. With N_NEW = 0 it
// instead times prefill of every prompt and prints "prefill_s <seconds>".
#include "llama.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

static void set_tokens(llama_batch_ext * batch, const llama_token * tokens, int32_t n, llama_pos pos_0) {
    llama_batch_ext_clear(batch);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t idx = llama_batch_ext_add_token(batch, 0, tokens[i]);
        const llama_pos pos = pos_0 + i;
        llama_batch_ext_set_pos(batch, idx, &pos);
    }
    llama_batch_ext_set_output_logits(batch, n - 1, true);
}

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL.gguf N_NEW < prompts.txt\n", argv[0]);
        return 2;
    }
    const int n_new = std::atoi(argv[2]);
    std::vector<std::vector<llama_token>> prompts;
    for (std::string line; std::getline(std::cin, line);) {
        std::istringstream in(line);
        std::vector<llama_token> ids;
        for (long id; in >> id;) ids.push_back((llama_token) id);
        if (!ids.empty()) prompts.push_back(ids);
    }
    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (model == nullptr) {
        fprintf(stderr, "error: llama.cpp could not load %s\n", argv[1]);
        return 1;
    }
    double prefill_s = 0.0;
    for (const auto & prompt : prompts) {
        llama_context_params cparams = llama_context_default_params();
        cparams.n_ctx = prompt.size() + n_new + 8;
        cparams.n_batch = prompt.size();
        cparams.n_ubatch = prompt.size();
        llama_context * ctx = llama_init_from_model(model, cparams);
        if (ctx == nullptr) {
            fprintf(stderr, "error: could not create a llama.cpp context\n");
            return 1;
        }
        llama_sampler * smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
        llama_sampler_chain_add(smpl, llama_sampler_init_greedy());
        llama_batch_ext * batch = llama_batch_ext_init(ctx);
        set_tokens(batch, prompt.data(), prompt.size(), 0);
        llama_pos pos = 0;
        int32_t n_batch = prompt.size();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < (n_new > 0 ? n_new : 1); ++i) {
            if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) {
                fprintf(stderr, "error: llama_process failed at generated token %d\n", i);
                return 1;
            }
            pos += n_batch;
            if (n_new == 0) break;
            llama_token next = llama_sampler_sample(smpl, ctx, -1);
            printf(i ? " %d" : "%d", next);
            set_tokens(batch, &next, 1, pos);
            n_batch = 1;
        }
        prefill_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (n_new > 0) printf("\n");
        fflush(stdout);
        llama_batch_ext_free(batch);
        llama_sampler_free(smpl);
        llama_free(ctx);
    }
    if (n_new == 0) printf("prefill_s %.6f\n", prefill_s);
    llama_model_free(model);
    return 0;
}
