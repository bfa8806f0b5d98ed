// llama.cpp's logits for a list of token-id prompts, and its greedy continuation of each:
// the reference that tools/dev/model_vs_llamacpp.py compares the project's model graph with
// on a file too large for the committed fixtures (the 8B-shaped GGUF).
//
//   llamacpp_logits MODEL.gguf TOKENS.bin OUT.bin N_GEN [N_GPU_LAYERS=99] [N_UBATCH=512]
//
// TOKENS.bin, int32 little endian: n_prompts, then per prompt its length and its token ids.
// Each prompt runs alone from an empty cache (sequence 0, flash attention on, F16 K/V): the
// prompt as one batch with every row's logits, then N_GEN greedy steps, each chosen token fed
// back alone (the last one evaluated too). N_UBATCH 1 evaluates the prompt one token per ubatch
// (on CUDA: the matrix-vector kernels, F32 accumulation, instead of cuBLAS GEMMs).
// OUT.bin, little endian: int32 n_vocab, n_prompts; per prompt: int32 n_prompt, n_gen,
// int32 tokens[n_prompt + n_gen] (prompt + greedy tokens), float32 logits[n_prompt + n_gen][n_vocab]
// (row j: the logits after token j).
//
// Build against a llama.cpp build (shared libraries; tools/dev/llamacpp_side_by_side.py does it):
//   g++ -O2 -std=c++17 llamacpp_logits.cpp -I SRC/include -I SRC/ggml/include -L BUILD/bin
//       -lllama -lggml -lggml-base -Wl,-rpath,'$ORIGIN' -o BUILD/bin/llamacpp_logits
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "llama.h"

static std::vector<int32_t> read_ints(const char *path) {
    std::vector<int32_t> out;
    FILE *f = std::fopen(path, "rb");
    if (!f) { std::fprintf(stderr, "cannot open %s\n", path); std::exit(2); }
    int32_t x;
    while (std::fread(&x, sizeof x, 1, f) == 1) out.push_back(x);
    std::fclose(f);
    return out;
}

static void decode_or_die(llama_context *ctx, llama_batch &batch) {
    if (llama_decode(ctx, batch) != 0) { std::fprintf(stderr, "llama_decode failed\n"); std::exit(3); }
}

int main(int argc, char **argv) {
    if (argc < 5) {
        std::fprintf(stderr, "usage: %s MODEL.gguf TOKENS.bin OUT.bin N_GEN [N_GPU_LAYERS] [N_UBATCH]\n", argv[0]);
        return 2;
    }
    const int n_gen = std::atoi(argv[4]);
    const int ngl = argc > 5 ? std::atoi(argv[5]) : 99;
    const int n_ubatch = argc > 6 ? std::atoi(argv[6]) : 512;
    std::vector<int32_t> in = read_ints(argv[2]);
    if (in.empty()) { std::fprintf(stderr, "empty token file\n"); return 2; }

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { std::fprintf(stderr, "cannot load %s\n", argv[1]); return 3; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 4096;
    cp.n_batch = 512;
    cp.n_ubatch = n_ubatch;
    cp.n_seq_max = 1;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { std::fprintf(stderr, "cannot make a context\n"); return 3; }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    FILE *out = std::fopen(argv[3], "wb");
    if (!out) { std::fprintf(stderr, "cannot write %s\n", argv[3]); return 2; }
    const int32_t n_prompts = in[0];
    std::fwrite(&n_vocab, sizeof n_vocab, 1, out);
    std::fwrite(&n_prompts, sizeof n_prompts, 1, out);
    llama_batch batch = llama_batch_init(512, 0, 1);
    size_t at = 1;
    for (int32_t p = 0; p < n_prompts; ++p) {
        const int32_t n = in[at++];
        if (n < 1 || n > 512 || at + n > in.size()) { std::fprintf(stderr, "bad prompt %d\n", p); return 2; }
        std::vector<int32_t> toks(in.begin() + at, in.begin() + at + n);
        at += n;
        std::vector<float> rows;
        llama_memory_clear(llama_get_memory(ctx), true);
        batch.n_tokens = n;
        for (int32_t i = 0; i < n; ++i) {
            batch.token[i] = toks[i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        decode_or_die(ctx, batch);
        for (int32_t i = 0; i < n; ++i) {
            const float *l = llama_get_logits_ith(ctx, i);
            rows.insert(rows.end(), l, l + n_vocab);
        }
        for (int step = 0; step < n_gen; ++step) {
            const float *last = rows.data() + rows.size() - n_vocab;
            int32_t best = 0;
            for (int32_t t = 1; t < n_vocab; ++t) if (last[t] > last[best]) best = t;
            toks.push_back(best);
            batch.n_tokens = 1;
            batch.token[0] = best;
            batch.pos[0] = (int32_t) toks.size() - 1;
            batch.n_seq_id[0] = 1;
            batch.seq_id[0][0] = 0;
            batch.logits[0] = 1;
            decode_or_die(ctx, batch);
            const float *l = llama_get_logits_ith(ctx, 0);
            rows.insert(rows.end(), l, l + n_vocab);
        }
        const int32_t head[2] = {n, n_gen};
        std::fwrite(head, sizeof(int32_t), 2, out);
        std::fwrite(toks.data(), sizeof(int32_t), toks.size(), out);
        std::fwrite(rows.data(), sizeof(float), rows.size(), out);
        std::fprintf(stderr, "prompt %d: %d tokens + %d generated\n", p, n, n_gen);
    }
    std::fclose(out);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
